"""Model families and the registry from Hugging Face `architectures` names to our classes."""

from __future__ import annotations

from tokenmill.errors import ConfigError
from tokenmill.models.layers import CausalLM
from tokenmill.models.llama import LlamaForCausalLM, MistralForCausalLM
from tokenmill.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ConfigError(
            f"architecture {architecture!r} is not supported; supported architectures: {supported}"
        ) from None


__all__ = ["MODEL_REGISTRY", "CausalLM", "model_class"]

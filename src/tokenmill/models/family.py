"""What tokenmill knows about one model family, declared in the family's own file (llama.py, qwen.py, ...).

A family names its Hugging Face `architectures` and `model_type`s, its model class, its quirks as
`adapt_config(hf_config) -> ModelConfig field overrides`, the transformers config class `make-model` uses,
and the GGUF arch the exporter writes. Adding a family is one file plus one line in `models/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.models.layers import CausalLM


def no_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    name: str  # `make-model --arch` name
    architectures: tuple[str, ...]  # HF `architectures` names; the first is what a config without one gets
    model_types: tuple[str, ...]  # HF `model_type` names
    model_class: type[CausalLM]
    hf_config_class: str  # transformers config class, for `make-model`
    gguf_arch: str | None = None  # `gguf.MODEL_ARCH` member the GGUF exporter writes (None: no export)
    gguf_permute_qk: bool = False  # that arch rotates interleaved pairs, HF rotates halves: permute Q/K rows
    adapt_config: Callable[[dict[str, Any]], dict[str, Any]] = field(default=no_quirks)

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        """Normalise a parsed config.json: the shared fields, then this family's quirks over them."""
        return ModelConfig.from_hf(hf, default_architecture=self.architectures[0], **self.adapt_config(hf))

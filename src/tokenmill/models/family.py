"""What tokenmill knows about one model family, declared in the family's own file (llama.py, qwen.py, ...).

A family names its Hugging Face `architectures` and `model_type`s, its model class, its quirks as
`adapt_config(hf_config) -> ModelConfig field overrides`, the transformers config class `make-model` uses,
the GGUF arch the exporter writes, and for a family with its own config names, how they map. Adding a family is
one file plus one line in `models/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.model_config import ModelConfig
from tokenmill.models.layers import CausalLM

# a checkpoint quantization the families load unless they say not: FP8 linears, dequantized as they stream in
FP8_METHOD = "fp8"


def no_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    return {}


def same_names(hf: dict[str, Any]) -> dict[str, Any]:
    return hf


def rope_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """make-model's shape fields for a rotary family: `rope_theta` / `rope_scaling` as v5 `rope_parameters`."""
    fields = dict(fields)
    theta = fields.pop("rope_theta", 10000.0)
    scaling = fields.pop("rope_scaling", None)
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    return fields


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
    # config.json in the family's own names (GPT-2's n_embd, ...) -> the shared names ModelConfig reads
    normalize_hf: Callable[[dict[str, Any]], dict[str, Any]] = field(default=same_names)
    # make-model's shape fields -> the family's transformers config arguments
    make_fields: Callable[[dict[str, Any]], dict[str, Any]] = field(default=rope_fields)
    # the `quantization_config.quant_method`s whose checkpoints the family loads (gpt-oss: its MXFP4 experts)
    quant_methods: tuple[str, ...] = ()
    # FP8 checkpoints (`fp8`: 2-D linear weights with block scales, weights/fp8.py); gpt-oss's 3-D experts are not
    loads_fp8: bool = True

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        """Normalise a parsed config.json: the shared fields, then this family's quirks over them. A checkpoint
        quantized in a way the family does not load is refused here, in one line, before any weight is read."""
        quant = hf.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        methods = (*self.quant_methods, *((FP8_METHOD,) if self.loads_fp8 else ()))
        if quant is not None and method not in methods:
            supported = ", ".join(methods)
            raise ConfigError(f"config.json: quantization_config quant_method {method!r} is not supported for "
                              f"{self.architectures[0]} checkpoints; supported: {supported}")  # fmt: skip
        hf = self.normalize_hf(hf)
        return ModelConfig.from_hf(hf, default_architecture=self.architectures[0], **self.adapt_config(hf))

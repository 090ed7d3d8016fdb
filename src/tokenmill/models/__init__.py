"""Model families and the registry: which family a checkpoint's config.json belongs to.

Adding a family: a file `models/<family>.py` with its model class and a `ModelFamily`, and one line below.
"""

from __future__ import annotations

from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.models.family import ModelFamily
from tokenmill.models.gemma3 import GEMMA3
from tokenmill.models.gpt2 import GPT2
from tokenmill.models.gpt_oss import GPT_OSS
from tokenmill.models.layers import CausalLM
from tokenmill.models.llama import LLAMA, MISTRAL
from tokenmill.models.mixtral import MIXTRAL
from tokenmill.models.phi3 import PHI3
from tokenmill.models.pooling import POOLING_ARCHITECTURES
from tokenmill.models.qwen import QWEN2, QWEN3, QWEN3_MOE

FAMILIES: tuple[ModelFamily, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    PHI3,
    GPT2,
    GEMMA3,
    QWEN3_MOE,
    MIXTRAL,
    GPT_OSS,
)


def family_for(hf: dict[str, Any]) -> ModelFamily:
    """The family of a parsed config.json: by its first `architectures` name (a pooling model's: the causal one that
    runs it, models/pooling.py), else by its `model_type`."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):  # ("LlamaForCausalLM" read as "L")
        raise ConfigError(f'architectures is {archs!r}; allowed a list of names, e.g. ["LlamaForCausalLM"]')
    if archs and archs[0] in POOLING_ARCHITECTURES:
        archs = [POOLING_ARCHITECTURES[archs[0]][0]]
    for family in FAMILIES:
        if (archs and archs[0] in family.architectures) or (not archs and hf.get("model_type") in family.model_types):
            return family
    name = archs[0] if archs else str(hf.get("model_type") or "<missing>")
    supported = ", ".join(sorted([*(a for f in FAMILIES for a in f.architectures), *POOLING_ARCHITECTURES]))
    raise ConfigError(f"architecture {name!r} is not supported; supported architectures: {supported}")


def family_named(name: str) -> ModelFamily:
    """The family `make-model --arch NAME` means."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"--arch {name!r} is not supported; allowed: {', '.join(f.name for f in FAMILIES)}")


__all__ = ["FAMILIES", "CausalLM", "ModelFamily", "family_for", "family_named"]

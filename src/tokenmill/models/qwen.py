"""Qwen families. Both are Llama-shaped; their quirks are config overrides:

- Qwen2 / Qwen2.5: bias on the q/k/v projections (always: the config has no switch), none on o_proj.
- Qwen3: RMSNorm over each head's q and k (`qk_norm`) before RoPE; biases follow `attention_bias`.
"""

from __future__ import annotations

from typing import Any

from tokenmill.models.family import ModelFamily
from tokenmill.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    pass


class Qwen3ForCausalLM(CausalLM):
    pass


def _qwen2_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, "o_proj_bias": False}


def _qwen3_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True}


# GGUF archs `qwen2`/`qwen3` rotate halves (NeoX style), as HF does: no Q/K permutation
QWEN2 = ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), Qwen2ForCausalLM, "Qwen2Config", "QWEN2",
                    adapt_config=_qwen2_quirks)  # fmt: skip
QWEN3 = ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), Qwen3ForCausalLM, "Qwen3Config", "QWEN3",
                    adapt_config=_qwen3_quirks)  # fmt: skip

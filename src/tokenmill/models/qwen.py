"""Qwen families. Both are Llama-shaped; their quirks are config overrides:

- Qwen2 / Qwen2.5: bias on the q/k/v projections (always: the config has no switch), none on o_proj.
- Qwen3: RMSNorm over each head's q and k (`qk_norm`) before RoPE; biases follow `attention_bias`.
- Qwen3-MoE: Qwen3 with mixture-of-experts MLPs (models/moe.py).
"""

from __future__ import annotations

from typing import Any

from tokenmill.model_config import MoEConfig
from tokenmill.models.family import ModelFamily
from tokenmill.models.layers import CausalLM
from tokenmill.models.moe import MoECausalLM


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


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3 attention (q/k norms) with sparse MLPs: top-k of `num_experts`, optionally renormalised
    (`norm_topk_prob`); `decoder_sparse_step` and `mlp_only_layers` leave some layers dense."""


def _qwen3_moe_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "moe": MoEConfig.from_hf(hf, int(hf.get("num_hidden_layers") or 0))}


QWEN3_MOE = ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), Qwen3MoeForCausalLM, "Qwen3MoeConfig",
                        "QWEN3MOE", adapt_config=_qwen3_moe_quirks)  # fmt: skip

"""Mixtral: Mistral's decoder with a mixture of experts in every layer's MLP, top-2 of 8 (models/moe.py).

The router's weights are renormalised over the chosen experts and scale their outputs in float32. Checkpoints name
the MoE block `block_sparse_moe` and an expert's gate, down and up projections `w1`, `w2` and `w3`.
"""

from __future__ import annotations

from typing import Any

from tokenmill.model_config import MoEConfig
from tokenmill.models.family import ModelFamily
from tokenmill.models.moe import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    hf_part_renames = (("block_sparse_moe", "mlp"), ("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))


def _mixtral_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    layers = int(hf.get("num_hidden_layers") or 0)
    return {"moe": MoEConfig.from_hf(hf, layers, norm_topk_prob=True, weights_in_float32=True)}


# a Mixtral GGUF is a `llama` file with experts: interleaved Q/K pairs, as Llama's
MIXTRAL = ModelFamily("mixtral", ("MixtralForCausalLM",), ("mixtral",), MixtralForCausalLM, "MixtralConfig", "LLAMA",
                      True, adapt_config=_mixtral_quirks)  # fmt: skip

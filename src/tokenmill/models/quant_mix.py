"""`--quantization q4_k_m` and `q5_k_m`: llama-quantize's Q4_K_M and Q5_K_M recipes for a float checkpoint, the
mixes most GGUF files hold. Every matrix is Q4_K (Q5_K) except, as llama-quantize assigns them:
- the LM head: Q6_K;
- the attention's V rows and the MLP's down projection in the layers `more_bits` picks (the first eighth, the last
  eighth and every third between): Q6_K. A fused q|k|v projection then becomes a `SegmentedLinear` of its q, k
  (base) and v (Q6_K) rows, as a GGUF's separate attn_q/attn_k/attn_v load.
Checked against llama-quantize's own Q4_K_M of the Qwen2.5-1.5B shape (28 layers: V and down in Q6_K in layers
0-2, 5, 8, ..., 23 and 24-27). Rows that are no whole superblocks fall back as each K-quant does
(formats.format_for)."""

from __future__ import annotations

import re

from torch import nn

MIXES = {"q4_k_m": "q4_k", "q5_k_m": "q5_k"}  # the recipe -> its base format
MORE = "q6_k"
_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of layers whose V and down projection get more bits."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def layer_count(model: nn.Module) -> int:
    found = [int(m.group(1)) for name, _ in model.named_modules() if (m := _LAYER.search(f"{name}."))]
    return max(found) + 1 if found else 0


def formats_for(mix: str, name: str, parent: nn.Module, n_layers: int) -> list[tuple[int, str]]:
    """The linear `name` (its parent module `parent`) as (rows, format) shards, in row order: one shard where the
    whole matrix takes one format."""
    base, leaf = MIXES[mix], name.rsplit(".", 1)[-1]
    if leaf == "lm_head":
        return [(-1, MORE)]
    found = _LAYER.search(f"{name}.")
    if found is None or not more_bits(int(found.group(1)), n_layers):
        return [(-1, base)]
    is_down = leaf == "down_proj" or (leaf == "c_proj" and ".mlp." in f"{name}.")  # (GPT-2's MLP output)
    if is_down:
        return [(-1, MORE)]
    if leaf == "qkv_proj":  # rows: q, then k and v of kv_size each (models/layers.py)
        q, kv = int(getattr(parent, "q_size")), int(getattr(parent, "kv_size"))  # noqa: B009
        return [(q + kv, base), (kv, MORE)]
    if leaf == "c_attn":  # GPT-2: q, k, v of equal widths
        width = int(getattr(parent, "c_attn").out_features) // 3  # noqa: B009
        return [(2 * width, base), (width, MORE)]
    return [(-1, base)]

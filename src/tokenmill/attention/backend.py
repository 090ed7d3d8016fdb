"""What every KV backend shares: where each sequence's new tokens sit in the flattened batch (`BatchLayout`), and the
per-sequence attention (`attend_sequence`). The protocol a backend follows is protocol.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.sinks import attend_with_sinks
from tokenmill.types import SequenceInput


@dataclass
class BatchLayout:
    """Where each sequence's new tokens sit in the flattened batch; every backend's metadata starts with it."""

    query_start_loc: list[int]  # [B+1] offsets of each sequence's new tokens in the flattened batch
    seq_lens: list[int]  # [B] context length after this step (cached + new)

    @classmethod
    def of(cls, sequences: Sequence[SequenceInput]) -> BatchLayout:
        starts = [0]
        for s in sequences:
            starts.append(starts[-1] + s.num_new_tokens)
        return cls(starts, [s.seq_len for s in sequences])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def _causal_mask(q_len: int, ctx_len: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[q_len, ctx_len] bool: query i (absolute position ctx_len - q_len + i) sees keys at positions <= its own,
    and with a window only the last `window` of them (HF's sliding-window mask: q - k < window)."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def window_of(windows: Sequence[int | None], layer: int) -> int | None:
    """A layer's attention window from a backend's per-layer list (empty: no windows)."""
    return windows[layer] if windows else None


def attend_sequence(
    q: torch.Tensor,  # [q_len, H, Dh]: one sequence's new queries
    keys: torch.Tensor,  # [Hkv, ctx_len, Dh]: its whole context
    values: torch.Tensor,  # [Hkv, ctx_len, Dh]
    window: int | None = None,  # each query sees only the last `window` positions (itself included)
    sinks: torch.Tensor | None = None,  # [H]: each head's sink logit (attention/sinks.py), or None
) -> torch.Tensor:  # [q_len, H, Dh]
    q_len, num_heads = q.shape[0], q.shape[1]
    if window is not None and keys.shape[1] > window:  # the window binds: keys no query can see are dropped first
        start = max(0, keys.shape[1] - q_len + 1 - window)
        keys, values = keys[:, start:], values[:, start:]
    else:
        window = None  # every query sees its whole context: plain causal
    ctx_len = keys.shape[1]
    if sinks is not None:
        hkv, dh = keys.shape[0], q.shape[2]
        grouped = q.view(q_len, hkv, num_heads // hkv, dh).permute(1, 2, 0, 3)[None]  # [1, Hkv, G, q_len, Dh]
        allowed = None if q_len == 1 else _causal_mask(q_len, ctx_len, q.device, window)  # [q_len, ctx]
        o = attend_with_sinks(grouped, keys[None], values[None], sinks, allowed)  # [1, Hkv, G, q_len, Dh]
        return o[0].permute(2, 0, 1, 3).reshape(q_len, num_heads, dh)
    queries = q.transpose(0, 1)  # [H, q_len, Dh]
    if num_heads != keys.shape[0]:  # NOTE: SDPA's fused CPU kernel wants 4-D inputs and equal head counts
        group = num_heads // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, ctx, Dh]
    if q_len == 1:  # (with a window, the keys were cut to it above)
        o = F.scaled_dot_product_attention(queries[None], keys[None], values[None])
    elif q_len == ctx_len and window is None:
        o = F.scaled_dot_product_attention(queries[None], keys[None], values[None], is_causal=True)
    else:
        mask = _causal_mask(q_len, ctx_len, q.device, window)
        o = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=mask)
    return o[0].transpose(0, 1)

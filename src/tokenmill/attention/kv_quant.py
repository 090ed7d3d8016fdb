"""The KV cache's storage dtype (`--kv-cache-dtype auto|bfloat16|int8`) and the int8 rows' pure-torch reference.

int8 keeps each (slot, KV head) row of Dh values as Dh int8 and one bfloat16 scale, absmax / 127 (llama.cpp's q8_0
KV, with one head's row as the block): Dh + 2 bytes where bf16 takes 2 Dh, so the same memory holds 1.94x the
tokens at Dh = 64 and 1.97x at Dh = 128. The CPU kernels (kernels/csrc/attention/kv_int8.h) quantize rows as they are
written and widen them a run at a time where attention reads them; these functions round exactly as they do, and
serve the paths without those kernels (a pool built with ops=None), which also only ever widen the rows they read.
"""

from __future__ import annotations

import torch

from tokenmill.config import KV_CACHE_DTYPES


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `--kv-cache-dtype` and the model's activation `dtype` ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}")


def bytes_per_row(head_dim: int, storage: torch.dtype) -> int:
    """The bytes of one (slot, KV head) row of keys or values: int8 values and their bf16 scale, or the elements."""
    return head_dim + 2 if storage == torch.int8 else head_dim * storage.itemsize


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., Dh] -> (int8 [..., Dh], bfloat16 scales [...]): scale = float32 absmax / 127 rounded up to a
    bfloat16 (so no value passes 127), each value x * (1 / scale) rounded to nearest even; an all-zero row has
    scale 0."""
    xf = x.float()
    bits = (xf.abs().amax(dim=-1) / 127).view(torch.int32)  # [...]: a positive float's bits
    up = (bits >> 16) + (bits & 0xFFFF != 0).to(torch.int32)  # the smallest bf16 at or above it
    s = (up << 16).view(torch.float32)
    scale = s.to(torch.bfloat16)  # exact
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)  # [..., Dh]
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., Dh] and their scales [...] -> [..., Dh] in `dtype` (through float32, as the kernels widen them)."""
    return (q.float() * scale.float()[..., None]).to(dtype)

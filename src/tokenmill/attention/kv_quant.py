"""The KV cache's storage dtype (`--kv-cache-dtype auto|bfloat16|int8|fp8`) and the quantized rows' pure-torch
reference.

int8 and fp8 keep each (slot, KV head) row of Dh values as Dh bytes and one bfloat16 scale (llama.cpp's q8_0 KV,
with one head's row as the block): int8 rows are round(x / scale) with scale = absmax / 127, fp8 rows are x / scale
as float8 e4m3 with scale = absmax / 448, each scale rounded up to a power of two (so that every widened value is
exact in bfloat16: a bf16 model reads the same values on every path without rounding them; ROW_FORMAT says which
rounding a pool's rows were written with). Dh + 2 bytes where bf16 takes 2 Dh: the same memory holds 1.94x the tokens
at Dh = 64 and 1.97x at Dh = 128. The CPU kernels (kernels/csrc/attention/kv_quant.h) quantize rows as they are
written and widen them a run at a time where attention reads them; these functions round exactly as they do, and
serve the paths without those kernels (a pool built with ops=None), which also only ever widen the rows they read.
"""

from __future__ import annotations

import torch

from tokenmill.config import KV_CACHE_DTYPES

QUANTIZED = (torch.int8, torch.float8_e4m3fn)
_TOP = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest code of each
ROW_FORMAT = "pow2-scale"  # how rows are quantized (the disk tier keys blocks by it): scales rounded up to 2^e


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `--kv-cache-dtype` and the model's activation `dtype` ("auto": the model's)."""
    named = {"auto": dtype, "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    if kv_cache_dtype not in named:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}")
    return named[kv_cache_dtype]


def bytes_per_row(head_dim: int, storage: torch.dtype) -> int:
    """The bytes of one (slot, KV head) row of keys or values: quantized values and their bf16 scale, or the
    elements."""
    return head_dim + 2 if storage in QUANTIZED else head_dim * storage.itemsize


def quantize_rows(x: torch.Tensor, storage: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., Dh] -> (int8 or float8_e4m3fn [..., Dh], bfloat16 scales [...]): scale = float32 absmax / 127
    (448 for fp8) rounded up to a power of two (so no value passes the largest code), each value x * (1 / scale)
    rounded to nearest even (to an integer, or to e4m3); an all-zero row has scale 0."""
    xf = x.float()
    bits = (xf.abs().amax(dim=-1) / _TOP[storage]).view(torch.int32)  # [...]: a positive float's bits
    up = (bits >> 23) + (bits & 0x7FFFFF != 0).to(torch.int32)  # the exponent of the power of two at or above it
    s = torch.where(bits == 0, 0, up << 23).view(torch.float32)
    scale = s.to(torch.bfloat16)  # exact
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    scaled = xf * inv[..., None]  # [..., Dh]
    if storage == torch.int8:
        return torch.round(scaled).clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantized rows [..., Dh] and their scales [...] -> [..., Dh] in `dtype` (through float32, as the kernels
    widen them)."""
    return (q.float() * scale.float()[..., None]).to(dtype)

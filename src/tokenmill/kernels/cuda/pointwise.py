"""The GPU's small fused ops, in Triton: RMSNorm (with the residual add), SwiGLU, rotate-half RoPE in place, and
the KV write. Each replaces several torch kernels with one launch.

Every op rounds where torch's ops round, so a bfloat16 model gives the tokens it gives with torch's ops:
`x + residual` is rounded to the model's dtype, the normalized row is rounded before the weight multiplies it
(Hugging Face's RMSNorm), `silu(gate)` is rounded before `* up`, and RoPE rounds `x * cos` and `rotated * sin`
before adding them. Arithmetic is float32 throughout; in a float32 model every rounding is a no-op.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream, rounded as torch's add
        tl.store(res_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * rms).to(x.dtype).to(tl.float32)  # rounded before the weight, as HF's RMSNorm
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (y * w).to(x.dtype), mask=mask)


@triton.jit
def _silu_mul(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # silu, rounded as torch's F.silu
    tl.store(out_ptr + row * inter + cols, (act * up).to(gate.dtype), mask=mask)


@triton.jit
def _round(x, like):
    """x (float32) rounded to `like`'s dtype, back in float32."""
    return x.to(like.dtype).to(tl.float32)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, row_stride, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    base = x_ptr + token * row_stride + head * 2 * HALF
    lo = tl.load(base + i, mask=mask, other=0.0)
    hi = tl.load(base + HALF + i, mask=mask, other=0.0)
    c_lo = tl.load(cos_ptr + token * 2 * HALF + i, mask=mask, other=0.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + token * 2 * HALF + HALF + i, mask=mask, other=0.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + token * 2 * HALF + i, mask=mask, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + token * 2 * HALF + HALF + i, mask=mask, other=0.0).to(tl.float32)
    a, b = lo.to(tl.float32), hi.to(tl.float32)
    new_lo = _round(a * c_lo, lo) + _round(-b * s_lo, lo)  # x * cos + rotate_half(x) * sin, rotate_half = (-b, a)
    new_hi = _round(b * c_hi, lo) + _round(a * s_hi, lo)
    tl.store(base + i, new_lo.to(lo.dtype), mask=mask)
    tl.store(base + HALF + i, new_hi.to(lo.dtype), mask=mask)


@triton.jit
def _kv_write(k_ptr, k_stride, v_ptr, v_stride, cache_ptr, slots_ptr, kv_offset, WIDTH: tl.constexpr,
              BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < WIDTH
    slot = tl.load(slots_ptr + token)
    k = tl.load(k_ptr + token * k_stride + i, mask=mask)
    v = tl.load(v_ptr + token * v_stride + i, mask=mask)
    tl.store(cache_ptr + slot * WIDTH + i, k, mask=mask)
    tl.store(cache_ptr + kv_offset + slot * WIDTH + i, v, mask=mask)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out: Tensor) -> None:
    rows, d = x.shape
    has_res = residual is not None
    _rmsnorm[(rows,)](x, residual if has_res else x, weight, out, d, eps, HAS_RES=has_res, BLOCK=next_pow2(d))


def launch_silu_mul(gate_up: Tensor, out: Tensor) -> None:
    rows, inter = out.shape
    block = min(1024, next_pow2(inter))
    _silu_mul[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)


def launch_rope(x: Tensor, cos: Tensor, sin: Tensor, heads: int, head_dim: int) -> None:
    half = head_dim // 2
    _rope[(x.shape[0], heads)](x, cos, sin, x.stride(0), HALF=half, BLOCK=next_pow2(half))


def launch_kv_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    width = k.shape[1] * k.shape[2]
    _kv_write[(k.shape[0],)](k, k.stride(0), v, v.stride(0), cache, slots, cache.stride(0), WIDTH=width,
                             BLOCK=next_pow2(width))  # fmt: skip

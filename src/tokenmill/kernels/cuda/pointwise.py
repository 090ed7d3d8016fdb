"""The GPU's small fused ops, in Triton: RMSNorm (with the residual add), SwiGLU and GeGLU, rotate-half RoPE in
place, the KV write, and RoPE with the KV write in one launch (after Qwen3's per-head norms, where a model has them).
Each replaces several torch kernels with one launch.

Every op rounds where torch's ops round, so a bfloat16 model gives the tokens it gives with torch's ops:
`x + residual` is rounded to the model's dtype, the normalized row is rounded before the weight multiplies it
(Hugging Face's RMSNorm), `silu(gate)` and `gelu(gate)` are rounded before `* up`, and RoPE rounds `x * cos` and
`rotated * sin` before adding them. Arithmetic is float32 throughout; in a float32 model every rounding is a no-op.
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
def _gelu_mul(gu_ptr, out_ptr, inter, TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if TANH:  # torch's approximate="tanh": 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2/(e^2y + 1)
        y = tl.minimum(0.7978845608028654 * (g + 0.044715 * g * g * g), 15.0)  # (tanh(15) is 1 in float32)
        act = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
    else:  # exact: 0.5 g (1 + erf(g / sqrt(2)))
        act = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    tl.store(out_ptr + row * inter + cols, (act.to(gate.dtype).to(tl.float32) * up).to(gate.dtype), mask=mask)


@triton.jit
def _round(x, like):
    """x (float32) rounded to `like`'s dtype, back in float32."""
    return x.to(like.dtype).to(tl.float32)


@triton.jit
def _rotate(a, b, like, cos_ptr, sin_ptr, token, i, mask, HALF: tl.constexpr):
    """A head's halves a, b (float32) rotated by the token's cos/sin rows, in `like`'s dtype: x * cos +
    rotate_half(x) * sin, rotate_half = (-b, a), each product rounded as torch's are."""
    c_lo = tl.load(cos_ptr + token * 2 * HALF + i, mask=mask, other=0.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + token * 2 * HALF + HALF + i, mask=mask, other=0.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + token * 2 * HALF + i, mask=mask, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + token * 2 * HALF + HALF + i, mask=mask, other=0.0).to(tl.float32)
    new_lo = _round(a * c_lo, like) + _round(-b * s_lo, like)
    new_hi = _round(b * c_hi, like) + _round(a * s_hi, like)
    return new_lo.to(like.dtype), new_hi.to(like.dtype)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, row_stride, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    base = x_ptr + token * row_stride + head * 2 * HALF
    lo = tl.load(base + i, mask=mask, other=0.0)
    hi = tl.load(base + HALF + i, mask=mask, other=0.0)
    new_lo, new_hi = _rotate(lo.to(tl.float32), hi.to(tl.float32), lo, cos_ptr, sin_ptr, token, i, mask, HALF)
    tl.store(base + i, new_lo, mask=mask)
    tl.store(base + HALF + i, new_hi, mask=mask)


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


@triton.jit
def _rope_kv(qkv_ptr, row_stride, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, cache_ptr, slots_ptr, kv_offset,
             Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
             BLOCK: tl.constexpr):  # fmt: skip
    """Program (token, head) over the q heads, then the k heads, of a fused qkv row: (RMSNorm by the q or k norm's
    weight,) RoPE in place, and for a k head its rotated row and its v head's row into the cache at the slot."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    base = qkv_ptr + token * row_stride + head * 2 * HALF
    lo = tl.load(base + i, mask=mask, other=0.0)
    hi = tl.load(base + HALF + i, mask=mask, other=0.0)
    a, b = lo.to(tl.float32), hi.to(tl.float32)
    is_k = head >= Q_HEADS
    if NORM:  # Qwen3's q_norm / k_norm over each head, rounded as HF's RMSNorm before and after the weight
        rms = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF) + eps)
        w_lo = tl.where(is_k, tl.load(kw_ptr + i, mask=mask, other=0.0), tl.load(qw_ptr + i, mask=mask, other=0.0))
        w_hi = tl.where(is_k, tl.load(kw_ptr + HALF + i, mask=mask, other=0.0),
                        tl.load(qw_ptr + HALF + i, mask=mask, other=0.0))  # fmt: skip
        a = _round(_round(a * rms, lo) * w_lo.to(tl.float32), lo)
        b = _round(_round(b * rms, lo) * w_hi.to(tl.float32), lo)
    new_lo, new_hi = _rotate(a, b, lo, cos_ptr, sin_ptr, token, i, mask, HALF)
    tl.store(base + i, new_lo, mask=mask)
    tl.store(base + HALF + i, new_hi, mask=mask)
    if is_k:
        kv_head = head - Q_HEADS
        slot = tl.load(slots_ptr + token)
        dst = cache_ptr + slot * KV_HEADS * 2 * HALF + kv_head * 2 * HALF
        tl.store(dst + i, new_lo, mask=mask)
        tl.store(dst + HALF + i, new_hi, mask=mask)
        v = qkv_ptr + token * row_stride + (Q_HEADS + KV_HEADS + kv_head) * 2 * HALF
        tl.store(dst + kv_offset + i, tl.load(v + i, mask=mask), mask=mask)
        tl.store(dst + kv_offset + HALF + i, tl.load(v + HALF + i, mask=mask), mask=mask)


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


def launch_gelu_mul(gate_up: Tensor, out: Tensor, tanh: bool) -> None:
    rows, inter = out.shape
    block = min(1024, next_pow2(inter))
    _gelu_mul[(rows, triton.cdiv(inter, block))](gate_up, out, inter, TANH=tanh, BLOCK=block)


def launch_rope(x: Tensor, cos: Tensor, sin: Tensor, heads: int, head_dim: int) -> None:
    half = head_dim // 2
    _rope[(x.shape[0], heads)](x, cos, sin, x.stride(0), HALF=half, BLOCK=next_pow2(half))


def launch_kv_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    width = k.shape[1] * k.shape[2]
    _kv_write[(k.shape[0],)](k, k.stride(0), v, v.stride(0), cache, slots, cache.stride(0), WIDTH=width,
                             BLOCK=next_pow2(width))  # fmt: skip


def launch_rope_kv_write(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int, head_dim: int,
                         cache: Tensor, slots: Tensor, norms: tuple[Tensor, Tensor, float] | None) -> None:  # fmt: skip
    half = head_dim // 2
    qw, kw, eps = norms if norms is not None else (cos, cos, 0.0)  # (unread without NORM)
    _rope_kv[(qkv.shape[0], heads + kv_heads)](qkv, qkv.stride(0), cos, sin, qw, kw, eps, cache, slots, cache.stride(0),
                                               Q_HEADS=heads, KV_HEADS=kv_heads, HALF=half, NORM=norms is not None,
                                               BLOCK=next_pow2(half))  # fmt: skip

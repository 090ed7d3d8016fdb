"""Weight-only int8 on the GPU (W8A16), in Triton: the product reads the int8 weight itself, one byte a weight, and
never writes a dequantized copy.

The weight keeps ggml's Q8_0 numbers (the CPU path's and a GGUF's): q [N, K] int8 and one float32 scale per 32
weights, d [N, K/32], so a model quantized here holds the same values on either device. Each program multiplies a
[BM, 32] tile of activations by a [32, BN] tile of q (converted to the activations' dtype, exactly: |q| <= 127)
on the tensor cores and adds the float32 result times the 32-block's scales, so the scale is applied once per
32 products instead of once per weight. Few rows (decode) leave most of the GPU idle with one program per output
tile, so the K axis is then split as well, and a second kernel adds the splits in a fixed order (no atomics: the
result does not depend on scheduling). Up to `GEMV_ROWS` rows a GEMV takes the product instead (`_q8_gemv`): the
tiles padded one decode row to 16 and read each weight row 32 bytes at a time, 0.30-0.59x cuBLAS's bf16 at one row
on an H200 (docs/benchmarks.md); the GEMV reads 128 contiguous bytes of a row a step on the CUDA cores. Written
and tested on the CPU (Triton's interpreter), not yet measured on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

TARGET_PROGRAMS = 264  # ~2 programs per multiprocessor of an H100/H200


@triton.jit
def _store(acc, rm, rn, M, N, split, bias_ptr, out_ptr, part_ptr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """A program's [BM, BN] float32 sums: to out (+ bias) in its dtype, or to its split's part of the float32 sums."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offsets = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * M * N + offsets, acc, mask=mask)


# NOTE: the row count and the split are not specialized: each distinct value would compile another kernel
@triton.jit(do_not_specialize=["M", "k_per_split"])
def _q8_linear(x_ptr, q_ptr, d_ptr, bias_ptr, out_ptr, part_ptr, M, N, KX, KP, k_per_split,
               HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr,
               SPLIT: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    split = tl.program_id(2)
    kk = tl.arange(0, 32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, KP)
    acc = tl.zeros([BM, BN], tl.float32)
    rows_x = rm.to(tl.int64)[:, None] * KX
    rows_q = rn.to(tl.int64)[None, :] * KP
    for k0 in range(k_lo, k_hi, 32 * GROUPS):
        for j in tl.static_range(GROUPS):
            k = k0 + j * 32 + kk  # [32]
            x = tl.load(x_ptr + rows_x + k[None, :], mask=(rm < M)[:, None] & (k < KX)[None, :], other=0.0)
            w = tl.load(q_ptr + rows_q + k[:, None], mask=(rn < N)[None, :] & (k < k_hi)[:, None], other=0)
            in_split = (rn * 0 + k0 + j * 32) < k_hi  # [BN]: this 32-block lies inside the split
            scale = tl.load(d_ptr + rn.to(tl.int64) * (KP // 32) + (k0 // 32 + j), mask=(rn < N) & in_split, other=0.0)
            if IEEE:  # float32 products (a float32 model; or the interpreter, whose bf16 dot multiplies raw bits)
                part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:  # exact: |q| <= 127 fits a bf16/fp16 mantissa
                part = tl.dot(x, w.to(x.dtype))
            acc += part * scale[None, :]
    _store(acc, rm, rn, M, N, split, bias_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)


@triton.jit(do_not_specialize=["total", "splits"])
def _sum_splits(part_ptr, bias_ptr, out_ptr, total, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):  # in order: the same sum every run
        acc += tl.load(part_ptr + s * total + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


# NOTE: as _q8_linear, the row count and the split are runtime arguments
@triton.jit(do_not_specialize=["M", "k_per_split"])
def _q8_gemv(x_ptr, q_ptr, d_ptr, bias_ptr, out_ptr, part_ptr, M, N, KX, KP, k_per_split,
             HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             SPLIT: tl.constexpr):  # fmt: skip
    """Few rows (M <= BM <= 4): each program reads BN weight rows BK contiguous bytes at a time (wide loads along
    K, no padding of the rows to a tensor-core tile) and sums products on the CUDA cores, the scale applied once per
    32-block."""
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, KP)
    kk = tl.arange(0, BK)
    kb = tl.arange(0, BK // 32)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + kk  # [BK]
        w = tl.load(q_ptr + rn.to(tl.int64)[:, None] * KP + k[None, :],
                    mask=(rn < N)[:, None] & (k < k_hi)[None, :], other=0).to(tl.float32)  # [BN, BK]  # fmt: skip
        blocks = k0 // 32 + kb  # [BK / 32]
        scale = tl.load(d_ptr + rn.to(tl.int64)[:, None] * (KP // 32) + blocks[None, :],
                        mask=(rn < N)[:, None] & (blocks * 32 < k_hi)[None, :], other=0.0)  # [BN, BK / 32]  # fmt: skip
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * KX + k[None, :],
                    mask=(rm < M)[:, None] & (k < KX)[None, :], other=0.0).to(tl.float32)  # [BM, BK]  # fmt: skip
        prod = tl.reshape(w[None, :, :] * x[:, None, :], (BM, BN, BK // 32, 32))  # [BM, BN, BK / 32, 32]
        acc += tl.sum(tl.sum(prod, axis=3) * scale[None, :, :], axis=2)
    _store(acc, rm, rn, M, N, split, bias_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT)


GEMV_ROWS = 4  # rows up to which the GEMV takes a product (decode at a few streams)


def _tiles(m: int) -> tuple[int, int, int]:
    """(BM, BN, warps) for m rows."""
    if m <= 16:
        return 16, 64, 4
    if m <= 64:
        return 64, 64, 4
    return 128, 128, 8


def launch_q8_linear(x: Tensor, q: Tensor, d: Tensor, bias: Tensor | None, out: Tensor) -> None:
    """x [M, KX] (KX <= KP) @ (q [N, KP] int8 * d [N, KP/32] float32)^T + bias [N] float32 -> out [M, N]."""
    m, kx = x.shape
    n, kp = q.shape
    if m <= GEMV_ROWS:
        return _launch_gemv(x, q, d, bias, out)
    bm, bn, warps = _tiles(m)
    groups = 4 if kp % 128 == 0 else 1
    splits, k_per_split = _splits(kp, 32 * groups, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    part = _parts(splits, m, n, x.device)
    has_bias = bias is not None
    _q8_linear[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
        x, q, d, bias if has_bias else d, out, part, m, n, kx, kp, k_per_split,
        HAS_BIAS=has_bias, BM=bm, BN=bn, GROUPS=groups, SPLIT=splits > 1,
        IEEE=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=warps,
    )  # fmt: skip
    _add_splits(part, bias, out, splits)


def _launch_gemv(x: Tensor, q: Tensor, d: Tensor, bias: Tensor | None, out: Tensor) -> None:
    m, kx = x.shape
    n, kp = q.shape
    bm = 1 if m == 1 else 2 if m == 2 else 4  # (three compiled variants at most)
    bn, bk = 16, 128 if kp % 128 == 0 else 32
    splits, k_per_split = _splits(kp, bk, triton.cdiv(n, bn))
    part = _parts(splits, m, n, x.device)
    has_bias = bias is not None
    _q8_gemv[(triton.cdiv(n, bn), splits)](
        x, q, d, bias if has_bias else d, out, part, m, n, kx, kp, k_per_split,
        HAS_BIAS=has_bias, BM=bm, BN=bn, BK=bk, SPLIT=splits > 1, num_warps=4,
    )  # fmt: skip
    _add_splits(part, bias, out, splits)


def _splits(kp: int, step: int, programs: int) -> tuple[int, int]:
    """(splits, k per split) of K, in whole steps: enough programs to fill the GPU, at most 16 splits."""
    steps = kp // step
    splits = max(1, min(TARGET_PROGRAMS // programs, steps, 16))
    k_per_split = triton.cdiv(steps, splits) * step
    return triton.cdiv(kp, k_per_split), k_per_split


def _parts(splits: int, m: int, n: int, device: torch.device) -> Tensor:  # [splits, M, N] float32 (unused: [1])
    return torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32, device=device)


def _add_splits(part: Tensor, bias: Tensor | None, out: Tensor, splits: int) -> None:
    """out = the splits' sums in order (+ bias), where K was split."""
    if splits > 1:
        m, n = out.shape
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](part, part if bias is None else bias, out, m * n, n, splits,
                                                 HAS_BIAS=bias is not None, BLOCK=block)  # fmt: skip

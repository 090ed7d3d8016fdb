"""Paged decode attention in Triton: one new query token per sequence, read against the paged KV pool through the
block tables in place (no gather into a padded copy, no padding bias).

The grid is (sequence, KV head, split). A program takes its KV head's G = H / Hkv query heads together, so GQA
reads each key once, and walks its split of the context in tiles of TILE positions with an online softmax. Each
position's block comes from the table (position // block_size), so a tile may span blocks. With more than one
split (long contexts, few sequences: too few programs to fill the GPU otherwise) each split writes its running
max, sum and weighted values, and a second kernel combines them in a fixed order, so the result does not depend
on scheduling. A sliding window skips the tiles before it and masks what precedes it inside a tile. Sinks (gpt-oss:
a logit per query head that joins the softmax's denominator and weighs no value, attention/sinks.py) join where
the softmax ends: in the one split's epilogue, or in the combine.

Scores and softmax are float32, products are elementwise (no tf32), so a float32 model matches SDPA to ~1e-6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenmill.kernels.cuda.pointwise import next_pow2

TILE = 32  # context positions a program reads per step of its loop
TARGET_PROGRAMS = 264  # ~2 programs per multiprocessor of an H100/H200 (132 of them)


# NOTE: the ints that change from step to step are neither constexprs nor specialized: each distinct value would
# compile another kernel (a 64-stream run with the split count as a constexpr spent ~3 s of 4.9 compiling)
@triton.jit(do_not_specialize=["table_width", "window", "split_len", "splits"])
def _decode(q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, sinks_ptr, kv_offset, table_width, scale,
            window, split_len, splits, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
            DH: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
            SINKS: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    heads = kvh * G + g  # [GP]
    qmask = (g < G)[:, None] & (d < DH)[None, :]
    q = tl.load(q_ptr + (b * H + heads)[:, None] * DH + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    q = q * scale  # [GP, DP]
    n = tl.load(lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(n - window, 0), 0)  # the first position attended to
    lo = tl.maximum(split * split_len, (first // TILE) * TILE)
    hi = tl.minimum((split + 1) * split_len, n)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    t = tl.arange(0, TILE)
    for start in range(lo, hi, TILE):
        pos = start + t  # [TILE]
        valid = (pos < hi) & (pos >= first)
        block = tl.load(tables_ptr + b * table_width + pos // BS, mask=valid, other=0)
        rows = (block * BS + pos % BS) * (HKV * DH) + kvh * DH  # [TILE] offsets of the keys in the pool
        kvmask = valid[:, None] & (d < DH)[None, :]
        k = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)  # [TILE, DP]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, TILE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(cache_ptr + kv_offset + rows[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if not SPLIT:
        if SINKS:  # the sink's exp joins the sum, rescaled to the larger of the two maxima
            sink = tl.load(sinks_ptr + heads, mask=g < G, other=0.0).to(tl.float32)
            top = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - top)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - top)
        out = acc / l_i[:, None]
        tl.store(out_ptr + (b * H + heads)[:, None] * DH + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)
    else:  # partials [B, H, SPLITS, DH + 2]: the weighted values, then the max and the sum
        base = part_ptr + ((b * H + heads) * splits + split) * (DH + 2)  # [GP]
        tl.store(base[:, None] + d[None, :], acc, mask=qmask)
        tl.store(base + DH, m_i, mask=g < G)
        tl.store(base + DH + 1, l_i, mask=g < G)


@triton.jit(do_not_specialize=["splits"])
def _combine(part_ptr, out_ptr, sinks_ptr, splits, H: tl.constexpr, DH: tl.constexpr, DP: tl.constexpr,
             SP: tl.constexpr, SINKS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # b * H + head
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    base = part_ptr + (row * splits + s) * (DH + 2)  # [SP]
    m = tl.load(base + DH, mask=s < splits, other=float("-inf"))
    total = tl.load(base + DH + 1, mask=s < splits, other=0.0)
    top = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + row % H).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # an empty split (no positions) weighs nothing
    acc = tl.load(base[:, None] + d[None, :], mask=(s < splits)[:, None] & (d < DH)[None, :], other=0.0)
    denominator = tl.sum(total * w, axis=0)
    if SINKS:
        denominator += tl.exp(sink - top)
    out = tl.sum(acc * w[:, None], axis=0) / denominator
    tl.store(out_ptr + row * DH + d, out.to(out_ptr.dtype.element_ty), mask=d < DH)


def splits_for(batch: int, kv_heads: int, max_positions: int) -> int:
    """How many splits of the context: enough programs to fill the GPU, each split at least one tile."""
    tiles = max(1, -(-max_positions // TILE))
    return max(1, min(tiles, TARGET_PROGRAMS // max(1, batch * kv_heads), 64))


def launch_decode(
    q: Tensor, cache: Tensor, tables: Tensor, lens: Tensor, block_size: int, window: int, out: Tensor, scale: float,
    sinks: Tensor | None = None,
) -> None:  # fmt: skip
    """q [B, H, Dh], cache [2, slots, Hkv, Dh], tables [B, M] int64, lens [B] int64 (, sinks [H] float32) -> out
    [B, H, Dh]."""
    b, h, dh = q.shape
    hkv, width = cache.shape[2], tables.shape[1]
    g = h // hkv
    splits = splits_for(b, hkv, width * block_size)
    split_len = triton.cdiv(triton.cdiv(width * block_size, splits), TILE) * TILE
    splits = triton.cdiv(width * block_size, split_len)
    part = torch.empty((b, h, splits, dh + 2) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    has_sinks = sinks is not None
    sinks_arg = sinks if sinks is not None else lens  # (unread without SINKS)
    _decode[(b, hkv, splits)](
        q, cache, tables, lens, out, part, sinks_arg, cache.stride(0), width, scale, window, split_len, splits,
        H=h, HKV=hkv, G=g, GP=next_pow2(g), DH=dh, DP=next_pow2(dh), BS=block_size, TILE=TILE, SPLIT=splits > 1,
        SINKS=has_sinks,
    )  # fmt: skip
    if splits > 1:  # SP: a power of two, so at most 6 variants of the combine are ever compiled (12 with sinks)
        _combine[(b * h,)](part, out, sinks_arg, splits, H=h, DH=dh, DP=next_pow2(dh), SP=next_pow2(splits),
                           SINKS=has_sinks)  # fmt: skip

"""Paged prefill attention in Triton: every prompt's new tokens of a step (prefills and chunks) in one launch per
layer, over the paged KV pool through the block tables in place, after the step's keys and values were written.
No gather of a cached prefix into a copy, no repeated keys for GQA, and no Python loop over the sequences.

The grid is (sequence, query head, tile of BM query rows); a program past its sequence's rows reads nothing. A
program walks the keys its rows may see (causal: up to its last row's position; with a window, from its first
row's window on) in tiles of BN positions, each position's block from the table, with an online softmax:
scores as `tl.dot` products, float32 sums (float32 models: IEEE float32 products, no tf32, so they match SDPA to
~1e-6), probabilities rounded to the values' dtype before their product (flash attention's rounding). Sinks
(gpt-oss) join each head's denominator at the end, as in the decode kernel (attention.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from tokenmill.kernels.cuda.pointwise import next_pow2

BM, BN = 32, 32  # query rows a program takes; key positions per step of its loop


# NOTE: the ints that change from step to step are not specialized (each value would compile another kernel)
@triton.jit(do_not_specialize=["q_stride", "table_width", "window"])
def _prefill(q_ptr, q_stride, cache_ptr, tables_ptr, seqs_ptr, out_ptr, sinks_ptr, kv_offset, table_width, scale,
             window, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, DH: tl.constexpr, DP: tl.constexpr,
             BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SINKS: tl.constexpr,
             IEEE: tl.constexpr):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    first_row = tl.load(seqs_ptr + seq * 3)
    q_len = tl.load(seqs_ptr + seq * 3 + 1)
    ctx = tl.load(seqs_ptr + seq * 3 + 2)
    r = tile * BM + tl.arange(0, BM)  # [BM] rows of this sequence
    rmask = r < q_len
    qpos = ctx - q_len + r  # [BM] each row's position in its sequence
    d = tl.arange(0, DP)
    dmask = d < DH
    rows = first_row + r
    q = tl.load(q_ptr + rows[:, None] * q_stride + head * DH + d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0)  # [BM, DP]  # fmt: skip
    kvh = head // G
    end = tl.minimum(ctx, ctx - q_len + tile * BM + BM)  # past the tile's last row's position
    end = tl.where(tile * BM < q_len, end, 0)  # a tile past the sequence's rows reads nothing and stores nothing
    # the tile's first row's window starts here (one expression, not a branch: a runtime `if` must give one type)
    lo = tl.where(window > 0, (tl.maximum(ctx - q_len + tile * BM - window + 1, 0) // BN) * BN, 0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    t = tl.arange(0, BN)
    for start in range(lo, end, BN):
        kpos = start + t  # [BN]
        kvalid = kpos < end
        block = tl.load(tables_ptr + seq * table_width + kpos // BS, mask=kvalid, other=0)
        offs = (block * BS + kpos % BS) * (HKV * DH) + kvh * DH  # [BN]
        kvmask = kvalid[:, None] & dmask[None, :]
        k = tl.load(cache_ptr + offs[:, None] + d[None, :], mask=kvmask, other=0.0)  # [BN, DP]
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")  # [BM, BN]
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        seen = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        seen = seen & ((window == 0) | (kpos[None, :] > qpos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: no NaN from -inf - -inf
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        v = tl.load(cache_ptr + kv_offset + offs[:, None] + d[None, :], mask=kvmask, other=0.0)  # [BN, DP]
        if IEEE:  # noqa: SIM108 (a constexpr branch: one dot is compiled)
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - top)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - top)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (l_i is 0 only in rows past the sequence's, never stored)
    tl.store(out_ptr + (rows * H + head)[:, None] * DH + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])  # fmt: skip


def launch_prefill(
    q: Tensor, cache: Tensor, tables: Tensor, seqs: Tensor, block_size: int, window: int, out: Tensor,
    sinks: Tensor | None, max_rows: int,
) -> None:  # fmt: skip
    """q [T, H, Dh] (rows strided, heads Dh apart), cache [2, slots, Hkv, Dh], tables [S, M] int64, seqs [S, 3]
    int64 (first row, new tokens, context length), sinks [H] float32 or None -> the sequences' rows of out
    [T, H, Dh]. `max_rows`: the most new tokens of any sequence (the grid's extent)."""
    h, dh = q.shape[1], q.shape[2]
    hkv = cache.shape[2]
    grid = (seqs.shape[0], h, triton.cdiv(max_rows, BM))
    # IEEE float32 products for a float32 model, and under Triton's interpreter, whose tl.dot of bf16 is wrong
    # (numpy has no bf16): there a bf16 model's products are float32's, which a GPU's bf16 tensor cores round
    ieee = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _prefill[grid](
        q, q.stride(0), cache, tables, seqs, out, sinks if sinks is not None else seqs, cache.stride(0),
        tables.shape[1], dh**-0.5, window, H=h, HKV=hkv, G=h // hkv, DH=dh, DP=max(16, next_pow2(dh)), BS=block_size,
        BM=BM, BN=BN, SINKS=sinks is not None, IEEE=ieee,
    )  # fmt: skip

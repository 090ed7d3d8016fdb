"""A mixture of experts' MLP on the GPU in two grouped GEMMs (Triton), without a host sync, so CUDA graphs can record
a MoE model's decode steps.

P = T * k (token, expert) pairs, pair p = t * k + j being token t's j-th choice. `align` sorts the pairs by expert
on the device and lays each expert's pairs out in blocks of BM slots (the last one padded with P, "no pair"), so
every block belongs to one expert; the grid covers the most blocks any routing can need (P / BM + E), and the
programs past the routing's own count return at once. Each program multiplies its block's rows by its expert's
weight [N, K] on the tensor cores, and writes row p of the result at p: pairs keep their place, no atomics.

    gate_up [P, 2I] = x[p // k] @ W1[e]^T       (the rows gathered from x by token)
    act     [P, I]  = silu(gate) * up           (pointwise.py's kernel, as a dense MLP's)
    out     [P, D]  = w_p * (act[p] @ W2[e]^T)  (float32, times the pair's routing weight)

and the caller adds each token's k rows in its experts' order (models/moe.py), as the per-expert path does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

BM = 16  # slots a block (pairs of one expert); a decode step's few pairs an expert fill one


@triton.jit(do_not_specialize=["P", "N", "K"])
def _grouped_gemm(a_ptr, w_ptr, out_ptr, slots_ptr, block_expert_ptr, blocks_ptr, weight_ptr, P, N, K,
                  TOP_K: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    block = tl.program_id(0)
    if block >= tl.load(blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pair = tl.load(slots_ptr + block * BM + tl.arange(0, BM))  # [BM]; P: an empty slot
    valid = pair < P
    row = (pair // TOP_K if GATHER else pair).to(tl.int64)  # [BM]: the row of `a` each slot reads
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    w_base = w_ptr + expert * N * K
    for k0 in range(0, K, BK):
        k = k0 + kk
        a = tl.load(a_ptr + row[:, None] * K + k[None, :], mask=valid[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_base + rn.to(tl.int64)[None, :] * K + k[:, None], mask=(rn < N)[None, :] & (k < K)[:, None],
                    other=0.0)  # [BK, BN]  # fmt: skip
        if IEEE:  # float32 products (a float32 model; or the interpreter, whose bf16 dot multiplies raw bits)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if WEIGHTED:
        acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    mask = valid[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def align(ids: Tensor, num_experts: int, bm: int = BM) -> tuple[Tensor, Tensor, Tensor]:
    """ids [T, k] (each token's experts) -> (slots [S] int64: each expert's pairs in blocks of `bm`, P where empty;
    block_expert [B] int64: each block's expert; blocks [1]: how many blocks the routing fills). Device ops only."""
    flat = ids.flatten()  # [P]
    pairs, device = flat.numel(), flat.device
    order = flat.argsort(stable=True)  # [P] the pairs grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm  # [E]
    ends = padded.cumsum(0)  # [E]
    first = counts.cumsum(0) - counts  # [E] each expert's first pair in `order`
    expert = flat[order]  # [P]
    slot = (ends - padded)[expert] + torch.arange(pairs, device=device) - first[expert]  # [P]
    max_blocks = triton.cdiv(pairs, bm) + num_experts
    slots = torch.full((max_blocks * bm,), pairs, dtype=torch.int64, device=device).scatter_(0, slot, order)
    starts = torch.arange(max_blocks, device=device) * bm  # [B]
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)  # [B]
    return slots, block_expert, (ends[-1:] // bm)


def grouped_gemm(a: Tensor, w: Tensor, out: Tensor, slots: Tensor, block_expert: Tensor, blocks: Tensor,
                 top_k: int, gather: bool, weights: Tensor | None) -> None:  # fmt: skip
    """out[p] = (weights[p] *) a[p // top_k if gather else p] @ w[e(p)]^T: a [R, K], w [E, N, K], out [P, N]."""
    n, k = w.shape[1], w.shape[2]
    bn = 64 if n >= 64 else triton.next_power_of_2(n)
    bk = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (slots.numel() // BM, triton.cdiv(n, bn))
    _grouped_gemm[grid](
        a, w, out, slots, block_expert, blocks, w if weights is None else weights, out.shape[0], n, k,
        TOP_K=top_k, GATHER=gather, WEIGHTED=weights is not None, BM=BM, BN=bn, BK=bk,
        IEEE=a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1", num_warps=4,
    )  # fmt: skip

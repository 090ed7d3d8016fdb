"""The attention kernels (decode: one new token per sequence; prefill: many) against torch's SDPA in float32, on
every kernel variant this CPU runs, over paged caches whose blocks lie in random order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.tile_paths import amx_mode, tile_modes
from tokenmill import kernels

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, ctx: int, block_size: int,
              window: int | None) -> torch.Tensor:  # fmt: skip
    """q [n, H, Dh]: the last n of a sequence's ctx positions, over its cache blocks (table) -> [n, H, Dh] float32."""
    n, heads = q.shape[0], q.shape[1]
    pos = torch.arange(ctx)
    slots = table[pos // block_size] * block_size + pos % block_size
    group = heads // cache.shape[2]
    keys = cache[0, slots].transpose(0, 1).float().repeat_interleave(group, 0)  # [H, ctx, Dh]
    values = cache[1, slots].transpose(0, 1).float().repeat_interleave(group, 0)
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    mask = pos[None] <= q_pos
    if window:
        mask &= pos[None] > q_pos - window
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
# 64 and 96: AVX-512 BF16's path (96: a 64- and a 32-wide part); 18 over 2: more heads than its registers hold;
# groups of 3, 5 and 6 heads per KV head (Llama-3.2-3B, Qwen2.5-14B, Qwen2.5-1.5B) on that path: its other chunk sizes
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 4, 32), (8, 2, 64), (6, 1, 40), (18, 2, 64), (4, 2, 96), (12, 4, 64), (10, 2, 32), (12, 2, 128)],
)
@pytest.mark.parametrize("window", [None, 6, 13])  # 6: starts mid-block; 13: one sequence exactly its length
def test_decode_attention_over_paged_blocks_equals_sdpa(
    ops: kernels.Kernels, dtype: torch.dtype, tol: float, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    block_size, num_blocks = 4, 40
    cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim).to(dtype)
    lens = torch.tensor([1, 13, 37], dtype=torch.int64)  # one token, partial blocks, several blocks
    generator = torch.Generator().manual_seed(0)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:10] for _ in lens])  # [B, 10]
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    out = ops.decode_attention(q, cache, tables, lens, block_size, window)
    for b, n in enumerate(lens.tolist()):
        ref = reference(q[b : b + 1], cache, tables[b], n, block_size, window)[0]
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (6, 1, 40)])
@pytest.mark.parametrize("block_size", [16, 48, 256])  # 48: blocks that straddle splits; 256: a split inside a block
# 30: scores past e^88 (each split's own largest is taken out), whose float32 rounding is 30x larger too
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_decode_attention_over_several_splits_equals_sdpa_alone_and_batched(
    ops: kernels.Kernels, dtype: torch.dtype, tol: float, heads: int, kv_heads: int, head_dim: int, block_size: int,
    spread: float,
) -> None:  # fmt: skip
    """Contexts longer than a split (attention.h's kSplit positions, each split's softmax merged with the others'):
    exactly one split, one past it, several with a short last one, and windows that start mid-split; each against
    SDPA, and each sequence's output the same bits alone as in its batch."""
    split = int(ops.module.attention_split)
    gen = torch.Generator().manual_seed(head_dim + block_size)
    lens = torch.tensor([split, split + 1, 3 * split + 5, 2 * split], dtype=torch.int64)
    num_blocks = 2 * -(-int(lens.max()) // block_size)
    cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen) for _ in lens])  # [B, num_blocks]
    q = (spread * torch.randn(len(lens), heads, head_dim, generator=gen)).to(dtype)
    tol = max(tol, 3e-6 * spread)
    for window in (None, split + 7, 2 * split + 3):
        out = ops.decode_attention(q, cache, tables, lens, block_size, window)
        for b, n in enumerate(lens.tolist()):
            ref = reference(q[b : b + 1], cache, tables[b], n, block_size, window)[0]
            torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)
            alone = ops.decode_attention(q[b : b + 1], cache, tables[b : b + 1], lens[b : b + 1], block_size, window)
            assert torch.equal(alone[0], out[b])


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
# 64: vdpbf16ps for scores and values; 80: 5 vectors of 16 (a tail past 4); 1 KV head of 6: rows = tokens x 6;
# (2, 2, 32): one head per KV head, so a task takes 96 tokens (192 on AMX); 96: AMX's three 32-wide steps of Dh
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(2, 2, 32), (14, 2, 64), (6, 1, 80), (8, 2, 128), (4, 2, 96)]
)
@pytest.mark.parametrize("window", [None, 5, 70])  # 5: inside one key block; 70: longer than a block of 64
def test_prefill_attention_over_paged_blocks_equals_sdpa(
    ops: kernels.Kernels, dtype: torch.dtype, tol: float, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    """Fresh prompts and chunks after a cached context, in one call: one token; a few; 130 fresh ones (several task
    blocks of tokens and several key blocks of 64); 37 new after 63 cached; 3 after 67; 11 and 5 (rows = tokens x
    heads per KV head: the score tiles' remainder of 11 on 16 lanes, the value tiles' of 5). q's token rows are
    slices of wider rows (a fused qkv), and the rows before the first prefill (a step's decodes) are left alone."""
    block_size, num_blocks = 4, 120
    gen = torch.Generator().manual_seed(heads * head_dim)
    cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    specs = [(1, 1), (7, 7), (130, 130), (37, 100), (3, 70), (11, 11), (5, 60)]  # (new tokens, context length)
    decodes = 2
    rows, seqs = decodes, []
    for n, ctx in specs:
        seqs.append((rows, n, ctx))
        rows += n
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:40] for _ in specs])  # [S, 40]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)  # token rows (heads + 2 kv) * Dh apart
    for mode in tile_modes(ops):  # the vector tiles, and AMX's (a bf16 model's, Dh a multiple of 32) where allowed
        out = torch.full((rows, heads, head_dim), 7.0, dtype=dtype)
        with amx_mode(ops, mode):
            ops.prefill_attention(q, cache, tables, torch.tensor(seqs, dtype=torch.int64), block_size, window, out)
        assert torch.all(out[:decodes] == 7.0)
        for (start, n, ctx), table in zip(seqs, tables, strict=True):
            ref = reference(q[start : start + n], cache, table, ctx, block_size, window)
            torch.testing.assert_close(out[start : start + n].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("spread", [10.0, 100.0])
def test_prefill_attention_over_large_scores_equals_sdpa(
    ops: kernels.Kernels, dtype: torch.dtype, tol: float, spread: float
) -> None:
    """Queries `spread` times larger: scores past e^88, whose running maximum moves block by block (each block's
    probabilities against it, the earlier sums rescaled), on every tile path."""
    gen = torch.Generator().manual_seed(int(spread))
    heads, kv_heads, head_dim, block_size, num_blocks, n, ctx = 14, 2, 64, 16, 64, 300, 1000
    cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)
    q = (spread * torch.randn(n, heads, head_dim, generator=gen)).to(dtype)
    ref = reference(q, cache, table, ctx, block_size, None)
    for mode in tile_modes(ops):
        out = torch.empty_like(q)
        with amx_mode(ops, mode):
            ops.prefill_attention(q, cache, table[None], torch.tensor([[0, n, ctx]]), block_size, None, out)
        torch.testing.assert_close(out.float(), ref, atol=max(tol, 3e-6 * spread), rtol=tol)


def test_bf16_prefill_attention_is_as_close_to_exact_as_sdpa(ops: kernels.Kernels) -> None:
    """In bf16, the kernel's outputs are no further from float64 attention than torch's SDPA's (which keeps the
    probabilities in float32: rounding them to bf16 put a model's outputs 1.4x further away), on every tile path."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dh, n, block_size = 14, 2, 64, 300, 4
    cache = torch.randn(2, n, kv_heads, dh, generator=gen).to(torch.bfloat16)
    q = torch.randn(n, heads, dh, generator=gen).to(torch.bfloat16)
    table = torch.arange(n // block_size)
    keys = cache[0].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [H, n, Dh]
    values = cache[1].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    exact = F.scaled_dot_product_attention(q.transpose(0, 1).double(), keys.double(), values.double(), is_causal=True)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True)
    outs = []
    for mode in tile_modes(ops):  # AMX's tiles take the probabilities as two bf16 parts: ~2^-17 of each
        outs.append(torch.empty_like(q))
        with amx_mode(ops, mode):
            ops.prefill_attention(q, cache, table[None], torch.tensor([[0, n, n]]), block_size, None, outs[-1])
        ours = (outs[-1].transpose(0, 1).double() - exact).abs().mean()
        assert ours <= 1.05 * (sdpa.double() - exact).abs().mean(), mode
    assert len(outs) == 1 or not torch.equal(outs[0], outs[1])  # AMX's ran: its sums come in another order


def test_prefill_attention_refuses_what_it_cannot_take(ops: kernels.Kernels) -> None:
    cache = torch.zeros(2, 8, 1, 24)
    q, seqs, tables = torch.zeros(2, 1, 24), torch.tensor([[0, 2, 2]]), torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="Dh % 16"):
        ops.prefill_attention(q, cache, tables, seqs, 4, None, torch.empty_like(q))

"""Attention sinks (gpt-oss: a learned logit per head in the softmax's denominator) in every path that attends: the
decode and prefill kernels on every variant this CPU runs, the torch path the KV backends fall back to, and the
paged pool's own choice between them, each against transformers' eager formula written out here."""

from __future__ import annotations

import pytest
import torch

from tests.unit.tile_paths import amx_mode, tile_modes
from tokenmill import kernels
from tokenmill.attention import PagedKVCache
from tokenmill.attention.backend import attend_sequence
from tokenmill.types import SequenceInput

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def eager(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
          window: int | None) -> torch.Tensor:  # fmt: skip
    """transformers' `eager_attention_forward` of modeling_gpt_oss, float64: q [n, H, Dh] the last n of ctx positions,
    keys/values [ctx, Hkv, Dh] -> [n, H, Dh]."""
    n, heads, dh = q.shape
    ctx, group = keys.shape[0], heads // keys.shape[1]
    k = keys.double().transpose(0, 1).repeat_interleave(group, 0)  # [H, ctx, Dh]
    v = values.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * dh**-0.5  # [H, n, ctx]
    q_pos, k_pos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None]
    seen = (k_pos <= q_pos) & (k_pos > q_pos - window if window else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    logits = torch.cat([scores, sinks.double().view(heads, 1, 1).expand(heads, n, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return (probs @ v).transpose(0, 1)  # [n, H, Dh]


def _paged(ctx: int, kv_heads: int, dh: int, dtype: torch.dtype, gen: torch.Generator, block_size: int = 4):
    """A context's keys and values [ctx, Hkv, Dh], in a cache [2, slots, Hkv, Dh] whose blocks lie in random order."""
    blocks = -(-ctx // block_size)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks]
    cache = torch.randn(2, 2 * blocks * block_size, kv_heads, dh, generator=gen).to(dtype)
    pos = torch.arange(ctx)
    slots = table[pos // block_size] * block_size + pos % block_size
    return cache, table, cache[0, slots], cache[1, slots]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (8, 1, 64), (6, 3, 16)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_kernel_with_sinks_equals_eager(
    ops: kernels.Kernels, dtype: torch.dtype, tol: float, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    """One split and several (contexts past the kernel's split length), sinks below, among and above the scores."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    split = int(ops.module.attention_split)
    for ctx in (1, 9, split + 3, 2 * split + 40):
        cache, table, keys, values = _paged(ctx, kv_heads, head_dim, dtype, gen)
        q = torch.randn(1, heads, head_dim, generator=gen).to(dtype)
        sinks = torch.linspace(-4.0, 4.0, heads)
        out = ops.decode_attention(q, cache, table[None], torch.tensor([ctx]), 4, window, sinks)
        want = eager(q, keys, values, sinks, window)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (8, 1, 64), (6, 3, 16)])
@pytest.mark.parametrize("window", [None, 7, 70])
def test_prefill_kernel_with_sinks_equals_eager(
    ops: kernels.Kernels, dtype: torch.dtype, tol: float, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    """A fresh prompt longer than a key block and a chunk after a cached context, in one call."""
    gen = torch.Generator().manual_seed(heads + head_dim)
    sinks = torch.linspace(3.0, -3.0, heads)
    for new, ctx in ((90, 90), (13, 50)):
        cache, table, keys, values = _paged(ctx, kv_heads, head_dim, dtype, gen)
        q = torch.randn(new, heads, head_dim, generator=gen).to(dtype)
        for mode in tile_modes(ops):  # the vector tiles, and AMX's where allowed
            out = torch.empty_like(q)
            with amx_mode(ops, mode):
                ops.prefill_attention(q, cache, table[None], torch.tensor([[0, new, ctx]]), 4, window, out, sinks)
            torch.testing.assert_close(out.double(), eager(q, keys, values, sinks, window), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 5])
def test_torch_path_with_sinks_equals_eager(window: int | None) -> None:
    """attend_sequence (the contiguous and recompute backends, the pool's prompts without kernels), chunked so the
    scores of a long prompt are never held at once."""
    from tokenmill.attention import sinks as sink_module

    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 40, 2, 16, generator=gen)  # [ctx, Hkv, Dh] each
    q, sinks = torch.randn(12, 6, 16, generator=gen), torch.randn(6, generator=gen)
    want = eager(q, keys, values, sinks, window)
    got = attend_sequence(q, keys.transpose(0, 1), values.transpose(0, 1), window, sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sink_module, "SCORES_PER_CHUNK", 6 * 40 * 5)  # 5 rows of queries at a time
        chunked = attend_sequence(q, keys.transpose(0, 1), values.transpose(0, 1), window, sinks)
    # torch's matmuls on 5 rows and on 12 may round differently (AVX2 builds do: 1.5e-7 on a Zen 3), so the chunks
    # must give every row its own result, not the same bits; a row taken from the wrong chunk is off by ~1
    torch.testing.assert_close(chunked, got, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("with_kernels", [True, False])
def test_paged_pool_with_sinks_equals_eager(with_kernels: bool) -> None:
    """The paged pool's decodes (batched) and prompts (a fresh one and a chunk after its cache) in one step, with the
    CPU kernels or torch's attention."""
    ops = kernels.active() if with_kernels else None
    if with_kernels and ops is None:
        pytest.skip("no compiled CPU kernels here")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dh, bs = 4, 2, 16, 4
    pool = PagedKVCache(1, 32, bs, kv_heads, dh, torch.float32, torch.device("cpu"), ops, [6])
    sinks = torch.tensor([-1.0, 0.5, 2.0, 8.0])
    # a decoding sequence (9 cached, blocks 0-2), a prompt's chunk after 8 cached (blocks 3-5), a fresh prompt
    seqs = [SequenceInput("d", [1], 9, [0, 1, 2], 40, None), SequenceInput("c", [1] * 4, 8, [3, 4, 5], 40, None),
            SequenceInput("f", [1] * 7, 0, [6, 7], 40, None)]  # fmt: skip
    meta = pool.prepare(seqs, num_decodes=1)
    pool.cache[0, :, :32] = torch.randn(2, 32, kv_heads, dh, generator=gen)  # the earlier steps' keys and values
    q = torch.randn(1 + 4 + 7, heads, dh, generator=gen)
    k_new, v_new = torch.randn(2, 12, kv_heads, dh, generator=gen)
    pool.write(0, k_new, v_new, meta)
    out = pool.attend(0, q, k_new, v_new, meta, sinks)
    for (start, end), s in zip(((0, 1), (1, 5), (5, 12)), seqs, strict=True):
        slots = torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(s.seq_len)])
        want = eager(q[start:end], pool.cache[0, 0, slots], pool.cache[0, 1, slots], sinks, 6)
        torch.testing.assert_close(out[start:end].double(), want, atol=1e-5, rtol=1e-5)

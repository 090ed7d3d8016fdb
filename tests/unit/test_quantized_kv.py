"""The quantized KV cache (`--kv-cache-dtype int8|fp8`): the kernels' writes equal the pure-torch quantizer's bytes,
and decode and prefill attention over quantized blocks equal SDPA over the same blocks widened, on every kernel
variant this CPU runs; the pool without kernels (ops=None) attends alike and moves whole blocks to and from the prefix
tiers."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_paged_attention_matches_sdpa import reference
from tests.unit.tile_paths import amx_mode, tile_modes
from tokenmill import kernels
from tokenmill.attention import PagedKVCache
from tokenmill.attention.kv_quant import dequantize_rows, quantize_rows, storage_dtype
from tokenmill.types import SequenceInput

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]
STORAGE = [torch.int8, torch.float8_e4m3fn]
# the most a value moves, over its row's absmax (a scale rounded up to a power of two: up to twice absmax / top)
STEP = {torch.int8: 1 / 127, torch.float8_e4m3fn: 32 / 448}


def quantized_cache(gen: torch.Generator, slots: int, kv_heads: int, head_dim: int,
                    storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A layer's quantized cache [2, slots, Hkv, Dh] and scales [2, slots, Hkv] from rows of very different sizes."""
    rows = torch.randn(2, slots, kv_heads, head_dim, generator=gen)
    rows *= torch.logspace(-2, 0.5, slots)[None, :, None, None]  # rows of 1e-2 to 3
    return quantize_rows(rows, storage)


def widened(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(q, scales, torch.float32)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40, 128])  # 40: a tail past whole vectors
def test_kv_write_quantizes_rows_into_their_slots_as_torch_does(
    ops: kernels.Kernels, storage: torch.dtype, dtype: torch.dtype, tol: float, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    tokens, kv_heads, slots = 9, 2, 24
    kv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen)
    kv *= torch.logspace(-6, 3, tokens)[:, None]  # tiny rows to large ones
    kv[3] = 0.0  # a row of zeros: scale 0, zeros
    kv = kv.to(dtype)
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)  # strided rows, as slices of a fused qkv
    v = kv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    cache = torch.full((2, slots, kv_heads, head_dim), 99, dtype=torch.int8).view(storage)
    scales = torch.full((2, slots, kv_heads), 5.0, dtype=torch.bfloat16)
    where = torch.randperm(slots, generator=gen)[:tokens]
    ops.kv_write(k, v, cache, where, scales)
    for half, x in enumerate((k, v)):
        q, s = quantize_rows(x, storage)
        assert torch.equal(cache[half, where].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales[half, where], s)
        back = dequantize_rows(cache[half, where], scales[half, where], torch.float32)
        err = (back - x.float()).abs().amax(-1)
        assert torch.all(err <= x.float().abs().amax(-1) * STEP[storage] * 1.02 + 1e-30)  # the scale rounded up
        mantissa, _ = torch.frexp(s.float())
        assert torch.all((mantissa == 0.5) | (s == 0))  # powers of two: so the widened values are exact in bf16
        assert torch.equal(back.to(torch.bfloat16).float(), back)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[where] = False
    assert torch.all(cache[:, untouched].view(torch.int8) == 99) and torch.all(scales[:, untouched] == 5.0)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (6, 1, 40), (4, 2, 128)])
@pytest.mark.parametrize("window", [None, 13])
def test_decode_attention_over_quantized_blocks_equals_sdpa_over_them_widened(
    ops: kernels.Kernels, storage: torch.dtype, dtype: torch.dtype, tol: float, heads: int, kv_heads: int,
    head_dim: int, window: int | None,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(heads + head_dim)
    block_size, num_blocks = 4, 90
    cache, scales = quantized_cache(gen, num_blocks * block_size, kv_heads, head_dim, storage)
    lens = torch.tensor([1, 13, 37, 300], dtype=torch.int64)  # one token, partial blocks, several splits
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:80] for _ in lens])  # [B, 80]
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    out = ops.decode_attention(q, cache, tables, lens, block_size, window, scales=scales)
    full = widened(cache, scales)
    full = full.to(dtype).float()  # a bf16 model reads the rows rounded to bf16, as every path does
    for b, n in enumerate(lens.tolist()):
        ref = reference(q[b : b + 1], full, tables[b], n, block_size, window)[0]
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)
        alone = ops.decode_attention(q[b : b + 1], cache, tables[b : b + 1], lens[b : b + 1], block_size, window,
                                     scales=scales)  # fmt: skip
        assert torch.equal(alone[0], out[b])


@pytest.mark.parametrize("storage", STORAGE)
# 2 KV heads: groups of 7 and 10, and of 1, 3, 5 and 6 (each a chunk size of AVX-512 BF16's score and value steps)
@pytest.mark.parametrize(("heads", "head_dim"), [(14, 64), (14, 40), (20, 96), (2, 64), (6, 32), (10, 64), (12, 128)])
def test_decode_attention_over_quantized_blocks_gives_the_bits_of_their_bf16_widening(
    ops: kernels.Kernels, storage: torch.dtype, heads: int, head_dim: int
) -> None:
    """A bf16 model's decode over a quantized cache is bit for bit its decode over the same rows widened to a bf16
    cache: the power-of-two scales make the widening exact, whichever way a variant takes it (the codes widened in
    registers and the scales folded into scores and weights; Dh 96 takes AVX-512 BF16's 16-wide value step, 20 heads
    per KV head its second group of 8 for the scores)."""
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks, kv_heads = 16, 40, 2
    cache, scales = quantized_cache(gen, num_blocks * block_size, kv_heads, head_dim, storage)
    lens = torch.tensor([1, 29, 300, 517], dtype=torch.int64)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:33] for _ in lens])  # [B, 33]
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    out = ops.decode_attention(q, cache, tables, lens, block_size, scales=scales)
    bf16_cache = widened(cache, scales).to(torch.bfloat16)
    assert torch.equal(widened(cache, scales), bf16_cache.float())  # (exact)
    assert torch.equal(out, ops.decode_attention(q, bf16_cache, tables, lens, block_size))


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (6, 1, 80)])
@pytest.mark.parametrize("window", [None, 70])
def test_prefill_attention_over_quantized_blocks_equals_sdpa_over_them_widened(
    ops: kernels.Kernels, storage: torch.dtype, dtype: torch.dtype, tol: float, heads: int, kv_heads: int,
    head_dim: int, window: int | None,
) -> None:  # fmt: skip
    """As the bf16 test: fresh prompts and chunks after a cached context in one call. A bf16 model's tiles multiply
    bf16 keys, so a bf16 model reads the rows widened and rounded to bf16 (so does the reference)."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    block_size, num_blocks = 4, 120
    cache, scales = quantized_cache(gen, num_blocks * block_size, kv_heads, head_dim, storage)
    specs = [(1, 1), (130, 130), (37, 100)]  # (new tokens, context length)
    rows, seqs = 0, []
    for n, ctx in specs:
        seqs.append((rows, n, ctx))
        rows += n
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:40] for _ in specs])  # [S, 40]
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    full = widened(cache, scales)
    full = full.to(dtype).float()  # (as the decode test)
    for mode in tile_modes(ops):  # the vector tiles, and AMX's where allowed
        out = torch.empty_like(q)
        with amx_mode(ops, mode):
            ops.prefill_attention(q, cache, tables, torch.tensor(seqs, dtype=torch.int64), block_size, window, out,
                                  scales=scales)  # fmt: skip
        for (start, n, ctx), table in zip(seqs, tables, strict=True):
            ref = reference(q[start : start + n], full, table, ctx, block_size, window)
            torch.testing.assert_close(out[start : start + n].float(), ref, atol=tol, rtol=tol)


def test_the_kernels_refuse_a_quantized_cache_without_scales(ops: kernels.Kernels) -> None:
    cache = torch.zeros(2, 8, 1, 32, dtype=torch.int8)
    q, tables, lens = torch.zeros(1, 1, 32), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs its scales"):
        ops.decode_attention(q, cache, tables, lens, 4)
    with pytest.raises(ValueError, match="do not match"):
        ops.decode_attention(q, cache, tables, lens, 4, scales=torch.zeros(2, 8, 2, dtype=torch.bfloat16))


def _pool(ops: kernels.Kernels | None, dtype: torch.dtype, storage: torch.dtype = torch.int8) -> PagedKVCache:
    return PagedKVCache(2, 12, 4, 2, 64, dtype, torch.device("cpu"), ops, storage=storage)


def _seq(rid: str, new: int, start: int, table: list[int]) -> SequenceInput:
    return SequenceInput(rid, [1] * new, start, table, 64, None)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantized_pool_attends_alike_with_and_without_kernels(
    ops: kernels.Kernels, dtype: torch.dtype, storage: torch.dtype
) -> None:
    """Two steps through `write` and `attend`: a prompt of 6, then its decode beside a fresh prefill of 6. The
    kernels' pool and the pure-torch one store the same bytes and attend within rounding (torch reads the fresh
    prompt's rows back from the pool, as the kernels do)."""
    steps = [([_seq("a", 6, 0, [0, 1])], 0), ([_seq("a", 1, 6, [0, 1]), _seq("b", 6, 0, [2, 3])], 1)]
    pools = [_pool(ops, dtype, storage), _pool(None, dtype, storage)]
    outs = []
    for pool in pools:
        gen = torch.Generator().manual_seed(3)
        for seqs, num_decodes in steps:
            meta = pool.prepare(seqs, num_decodes)
            t = sum(s.num_new_tokens for s in seqs)
            k, v = (torch.randn(t, 2, 64, generator=gen).to(dtype) for _ in range(2))
            q = torch.randn(t, 4, 64, generator=gen).to(dtype)
            pool.write(0, k, v, meta)
            out = pool.attend(0, q, k, v, meta)
        outs.append(out)
    assert pools[0].scales is not None and pools[1].scales is not None
    used = slice(0, 16)  # blocks 0-3's slots (the torch pool has a spare block, and unused blocks are not zeroed)
    assert torch.equal(pools[0].cache[:, :, used].view(torch.uint8), pools[1].cache[:, :, used].view(torch.uint8))
    assert torch.equal(pools[0].scales[:, :, used], pools[1].scales[:, :, used])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


def test_a_quantized_pool_moves_whole_blocks_with_their_scales() -> None:
    pool = _pool(None, torch.float32)
    assert pool.block_nbytes == 2 * 2 * 4 * 2 * (64 + 2)  # layers x (k, v) x block x heads x (Dh int8 + a half)
    assert PagedKVCache.bytes_per_block(2, 4, 2, 64, torch.bfloat16) / pool.block_nbytes == pytest.approx(1.94, 0.01)
    gen = torch.Generator().manual_seed(0)
    assert pool.scales is not None
    pool.cache.copy_(torch.randint(-127, 128, pool.cache.shape, generator=gen, dtype=torch.int8))
    pool.scales.copy_(torch.rand(pool.scales.shape, generator=gen).bfloat16())
    data = pool.read_block(3)
    other = _pool(None, torch.float32)
    other.write_block(5, data)
    assert other.scales is not None
    assert torch.equal(other.cache[:, :, 20:24], pool.cache[:, :, 12:16])
    assert torch.equal(other.scales[:, :, 20:24], pool.scales[:, :, 12:16])
    with pytest.raises(ValueError, match="bytes"):
        other.write_block(5, data[:-2])


def test_storage_dtype_names_what_is_allowed() -> None:
    assert storage_dtype("auto", torch.float32) == torch.float32
    assert storage_dtype("int8", torch.bfloat16) == torch.int8
    assert storage_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="allowed: auto, bfloat16, int8, fp8"):
        storage_dtype("fp4", torch.float32)

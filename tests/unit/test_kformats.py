"""The K family (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q4_1, IQ4_NL, IQ4_XS, MXFP4) from a GGUF's bytes to the kernels'
product, on every variant.

A GGUF block is any bytes, so the blocks here are random bytes (with finite fp16 scales): their numbers must be the
gguf package's dequantization exactly, they must repack into the kernels' panels without loss, and every kernel
variant must multiply them as the reference does (the weights dequantized, the rows quantized to Q8_0 blocks).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.unit.conftest import kernel_levels
from tests.unit.test_kernels import NO_AMX
from tests.unit.tile_paths import amx_mode, tile_modes
from tokenmill import kernels
from tokenmill.kernels import kformats
from tokenmill.kernels.formats import FORMATS, PackedWeight, pack, pack_block_weight, reference_linear, unpack
from tokenmill.kernels.kformats import KSPECS, decode_gguf_rows
from tokenmill.models.linear import KernelLinear, SegmentedLinear

GGML_TYPE = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "q5_0": "Q5_0", "q5_1": "Q5_1", "q4_1": "Q4_1",
             "iq4_nl": "IQ4_NL", "iq4_xs": "IQ4_XS", "mxfp4": "MXFP4"}  # fmt: skip
# the fp16 fields of each block: (byte offset, scale); the other bytes stay random
HALVES = {"q4_k": [(0, 0.02), (2, 0.01)], "q5_k": [(0, 0.02), (2, 0.01)], "q6_k": [(208, 0.004)],
          "q5_0": [(0, 0.05)], "q5_1": [(0, 0.05), (2, 0.3)], "q4_1": [(0, 0.05), (2, 0.3)],
          "iq4_nl": [(0, 0.005)], "iq4_xs": [(0, 0.0005)], "mxfp4": []}  # fmt: skip
# MXFP4's e8m0 exponent byte: (offset, its range), scales 2^-9 .. 2^-1 (the panels hold 2^-24 .. 2^15)
EXPONENTS = {"mxfp4": (0, 119, 128)}
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 70]  # every tile size, tiles split evenly, and a second block of 64 rows


def random_rows(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k / sb * bytes] uint8: ggml blocks of random bytes whose fp16 fields are finite, of either sign."""
    spec = KSPECS[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // spec.sb, spec.gguf_bytes), dtype=np.uint8)
    for at, scale in HALVES[fmt]:
        halves = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    if fmt in EXPONENTS:
        at, low, high = EXPONENTS[fmt]
        blocks[:, at] = rng.integers(low, high, size=len(blocks), dtype=np.uint8)
    return blocks.reshape(n, -1)


def gguf_reference(fmt: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[GGML_TYPE[fmt]]).astype(np.float32))


def shapes(fmt: str) -> list[tuple[int, int]]:  # (N, K): partial panels; one or several superblocks
    sb = KSPECS[fmt].sb
    return [(16, sb), (37, 2 * sb), (130, 3 * sb)] + ([(45, 224)] if sb == 32 else [])


@pytest.mark.parametrize("fmt", list(KSPECS))
def test_numbers_are_the_gguf_dequantization_and_repack_without_loss(fmt: str) -> None:
    for n, k in shapes(fmt):
        raw = random_rows(fmt, n, k)
        w = decode_gguf_rows(fmt, torch.from_numpy(raw), k)
        expected = gguf_reference(fmt, raw)
        torch.testing.assert_close(w.dequantize(), expected, rtol=0, atol=0)
        packed = pack_block_weight(w)
        assert packed.data.numel() == -(-n // 16) * k // KSPECS[fmt].sb * KSPECS[fmt].sb_bytes
        torch.testing.assert_close(unpack(packed), expected, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", list(KSPECS))
def test_the_kernels_unpack_to_the_gguf_dequantization(ops: kernels.Kernels, fmt: str) -> None:
    n, k = shapes(fmt)[1]
    raw = random_rows(fmt, n, k, seed=1)
    packed = pack_block_weight(decode_gguf_rows(fmt, torch.from_numpy(raw), k))
    got = ops.unpack(packed.data, FORMATS[fmt], n, k)
    torch.testing.assert_close(got, gguf_reference(fmt, raw), rtol=0, atol=0)


def _linear(ops: kernels.Kernels, p: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return ops.linear(x, p.data, p.format_id, p.out_features, p.padded_in, bias)


@pytest.mark.parametrize("fmt", list(KSPECS))
def test_every_row_count_equals_the_reference(ops: kernels.Kernels, fmt: str) -> None:
    """Each row count on the vector tiles, and on AMX's (from 9 rows) where this CPU has them: whichever the process's
    switch was left at (a batch-invariant model turns AMX off)."""
    torch.manual_seed(0)
    for n, k in shapes(fmt):
        packed = pack_block_weight(decode_gguf_rows(fmt, torch.from_numpy(random_rows(fmt, n, k)), k))
        bias = torch.randn(n)
        for rows, mode in ((r, m) for r in ROWS for m in tile_modes(ops)):
            x = torch.randn(rows, k)
            with amx_mode(ops, mode):
                got, got_bf16 = _linear(ops, packed, x, bias), _linear(ops, packed, x.bfloat16(), None)
            expected = reference_linear(x, packed, bias)
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 * expected.abs().max().item())
            expected = reference_linear(x.bfloat16(), packed, None)
            assert got_bf16.dtype == torch.bfloat16
            torch.testing.assert_close(got_bf16.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("fmt", list(KSPECS))
@pytest.mark.parametrize("half_width", [True, False])
def test_few_rows_on_either_tile_width(ops: kernels.Kernels, fmt: str, half_width: bool) -> None:
    """1-3 rows take the ymm K tiles on a Zen 4 and the zmm ones elsewhere (core/cpu.h: amd_half_width_512; the
    AVX-512 VNNI variants): each path on every CPU, whichever this one is."""
    n, k = shapes(fmt)[1]
    packed = pack_block_weight(decode_gguf_rows(fmt, torch.from_numpy(random_rows(fmt, n, k, seed=3)), k))
    before = ops.module.set_half_width(half_width)
    try:
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            got, expected = _linear(ops, packed, x, None), reference_linear(x, packed, None)
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 * expected.abs().max().item())
    finally:
        ops.module.set_half_width(before)


@pytest.mark.parametrize("fmt", list(KSPECS))
def test_a_row_gives_the_same_bits_alone_in_a_batch_and_in_spans(ops: kernels.Kernels, fmt: str) -> None:
    n, k = 48, 8 * KSPECS[fmt].sb  # enough superblocks for several spans
    packed = pack_block_weight(decode_gguf_rows(fmt, torch.from_numpy(random_rows(fmt, n, k, seed=2)), k))
    x = torch.randn(19, k)
    batch = _linear(ops, packed, x, None)
    for r in (0, 7, 18):
        assert torch.equal(_linear(ops, packed, x[r : r + 1], None)[0], batch[r])
    spans = ops.module.set_kspans(False)
    try:
        assert torch.equal(_linear(ops, packed, x, None), batch)
    finally:
        ops.module.set_kspans(spans)


@pytest.mark.parametrize("fmt", list(KSPECS))
def test_integer_sums_do_not_saturate(ops: kernels.Kernels, fmt: str) -> None:
    """Every q at its largest against rows quantized to +127 and -127: the 16-bit sums of the AVX2 tiles are at
    their bound, and widen before they overflow. IQ4's largest values: 113 (unsigned 241, vpdpbusd's) and -127
    (|-127|, the sign trick's of vpmaddubsw)."""
    spec = KSPECS[fmt]
    n, k = 16, spec.sb * 2
    w = decode_gguf_rows(fmt, torch.from_numpy(random_rows(fmt, n, k, seed=3)), k)
    for top in [15, 0] if spec.table else [(1 << (4 + spec.planes)) - 1]:
        packed = pack_block_weight(kformats.KBlockWeight(fmt, torch.full_like(w.q, top), w.d, w.dmin, w.sc, w.mn))
        x = torch.ones(2, k)
        x[1] = -1
        expected = reference_linear(x, packed)
        atol = 1e-5 * expected.abs().max().item()
        torch.testing.assert_close(_linear(ops, packed, x, None), expected, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", *KSPECS])
def test_the_kernels_repack_a_gguf_tensor_into_the_bytes_torch_packs(ops: kernels.Kernels, fmt: str) -> None:
    """The loader's one-pass repack (csrc/linear/repack.h) from the file's bytes equals decoding the numbers and
    packing them in torch, byte for byte; rows past N stay zero."""
    from tokenmill.kernels.raw_blocks import RawBlocks, pack_raw

    sb = KSPECS[fmt].sb if fmt in KSPECS else 32
    n, k = 37, 3 * sb
    if fmt in KSPECS:
        raw = torch.from_numpy(random_rows(fmt, n, k, seed=4))
    else:  # Q8_0 / Q4_0 rows from gguf's own quantizer
        w = np.random.default_rng(4).standard_normal((n, k)).astype(np.float32)
        raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt.upper()]))
    blocks = RawBlocks(fmt, raw, k)
    ours, want = pack_raw(blocks, ops), pack_raw(blocks, None)
    assert ours.format == want.format and torch.equal(ours.data, want.data)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "mxfp4"])
def test_reordered_blocks_are_gathered_only_when_read(ops: kernels.Kernels, fmt: str) -> None:
    """`RawBlocks.rows` (llama's Q/K rows put back in HF's order) keeps the order as an index: nothing is gathered
    until the rows are read, so a weight the packed cache holds is never copied; read, they are the gathered rows,
    packed (kernels and torch), decoded and sliced alike, and reorderings compose."""
    from tokenmill.kernels.raw_blocks import RawBlocks, mxfp4_fits, pack_raw

    n, k = 12, KSPECS[fmt].sb if fmt in KSPECS else 32
    if fmt in KSPECS:
        raw = torch.from_numpy(random_rows(fmt, n, k, seed=5))
    else:
        w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)
        raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
    first, second = torch.randperm(n, generator=torch.Generator().manual_seed(1)), torch.arange(n - 1, -1, -1)
    lazy = RawBlocks(fmt, raw, k).rows(first).rows(second)
    gathered = RawBlocks(fmt, raw[first][second], k)
    assert lazy.raw is raw and lazy.shape == gathered.shape == (n, k)  # nothing gathered yet
    assert torch.equal(lazy.blocks(), gathered.raw)
    for packer in (ops, None):
        assert torch.equal(pack_raw(lazy, packer).data, pack_raw(gathered, packer).data)
    assert torch.equal(lazy.dequantize(), gathered.dequantize())
    assert torch.equal(lazy.row_range(3, 7).blocks(), gathered.raw[3:7])
    assert torch.equal(RawBlocks.cat([lazy, gathered]).raw, torch.cat([gathered.raw, gathered.raw]))
    assert fmt != "mxfp4" or mxfp4_fits(lazy) == mxfp4_fits(gathered)


IQ4 = [f for f, spec in KSPECS.items() if spec.table]


@pytest.mark.parametrize("fmt", IQ4)
def test_iq4_gives_the_same_bits_on_every_simd_variant(fmt: str) -> None:
    """IQ4's sums are exact on every path (vpdpbusd on the unsigned table, or vpmaddubsw's sign trick on the signed
    one, on 8 or 16 lanes) and scaled alike: the same bits from every SIMD variant, 1 to 40 rows."""
    simd = [level for level in kernel_levels() if level != "scalar"]
    if len(simd) < 2:
        pytest.skip(f"one SIMD variant runs here ({simd}): nothing to compare it with")
    n, k = 80, 2 * KSPECS[fmt].sb
    packed = pack_block_weight(decode_gguf_rows(fmt, torch.from_numpy(random_rows(fmt, n, k, seed=5)), k))
    x = torch.randn(40, k)
    for rows in (1, 3, 4, 8, 9, 16, 40):
        outs = [_linear(kernels.variant(level), packed, x[:rows], None) for level in simd]
        for level, out in zip(simd[1:], outs[1:], strict=True):
            assert torch.equal(out, outs[0]), (level, rows)


@pytest.mark.parametrize("fmt", [*IQ4, "q4_k", "q5_k", "q6_k"])
def test_amx_gives_the_bits_of_the_vnni_tiles(ops: kernels.Kernels, fmt: str) -> None:
    """AMX multiplies IQ4's unsigned table values by the signed rows (TDPBSUD), and takes a K-quant a superblock at
    a time in byte planes of sc's digits times q (arch/amx/amx_ksuper.h), into the VNNI tiles' exact sums, scaled
    alike: the same bits at every row count, with both row blocks or a padded last 16 rows, several blocks of rows
    (a K-quant's: 1 MB of row bytes each, 128 rows here) and a lone last panel."""
    if not ops.module.amx_native():
        pytest.skip(NO_AMX)
    superblocks = fmt not in IQ4
    n, k = 80, 32 * 256 if superblocks else 2 * KSPECS[fmt].sb  # 5 panels: two pairs and one alone
    packed = pack_block_weight(decode_gguf_rows(fmt, torch.from_numpy(random_rows(fmt, n, k, seed=6)), k))
    x = torch.randn(300 if superblocks else 40, k)
    before = ops.module.set_amx(0)
    try:
        integer = _linear(ops, packed, x, None)
        ops.module.set_amx(1)
        for rows in (1, 7, 9, 16, 17, 21, 40, 128, 300):
            if rows <= len(x):
                assert torch.equal(_linear(ops, packed, x[:rows], None), integer[:rows]), rows
    finally:
        ops.module.set_amx(before)


@pytest.mark.parametrize("fmt", IQ4)
def test_iq4_is_not_a_quantization_target(fmt: str) -> None:
    """IQ4 loads from GGUF files only: packing a float weight to it is refused with the reason, not done wrong."""
    with pytest.raises(ValueError, match="GGUF files only"):
        pack(torch.randn(16, 256), fmt)


def test_a_fused_projections_shards_read_rows_quantized_alike(ops: kernels.Kernels) -> None:
    """A qkv of a Q5_0 and a Q6_K shard (rows quantized once for both in the decode stack, linear/segments.h): the
    Q5_0 shard too multiplies rows with one scale per superblock, in the kernel and in its torch reference."""
    k = 512
    parts = [pack_block_weight(decode_gguf_rows(fmt, torch.from_numpy(random_rows(fmt, n, k, seed=5)), k))
             for fmt, n in (("q5_0", 32), ("q6_k", 16))]  # fmt: skip
    fused = SegmentedLinear([KernelLinear(p, None, ops) for p in parts])
    assert [p.row_group for p in fused.parts] == [256, 0]  # 0: the format's own (Q6_K's 256)
    x = torch.randn(5, k)
    x[:, 40] = 30.0  # one large activation: a scale per block of 32 and one per 256 differ
    got = fused(x)
    want = torch.cat([reference_linear(x, parts[0], None, 256), reference_linear(x, parts[1])], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert not torch.allclose(got[:, :32], reference_linear(x, parts[0]), rtol=1e-4, atol=1e-3)


def test_a_hugging_face_mxfp4_weight_keeps_its_numbers() -> None:
    """gpt-oss's `*_blocks` / `*_scales` (two e2m1 codes a byte, value 2j low; e8m0 exponents) become MXFP4 panels
    whose weights are transformers' own dequantization exactly; a scale no fp16 holds is refused with its range."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 48, 4, 16), dtype=torch.uint8, generator=gen)  # [E, N, K / 32, 16]
    scales = torch.randint(118, 130, (2, 48, 4), dtype=torch.uint8, generator=gen)  # [E, N, K / 32]
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, N, K]
    for e in range(2):
        w = kformats.mxfp4_from_hf(blocks[e], scales[e])
        torch.testing.assert_close(w.dequantize(), want[e], rtol=0, atol=0)
        torch.testing.assert_close(unpack(pack_block_weight(w)), want[e], rtol=0, atol=0)
        gguf_bytes = kformats.encode_gguf_rows(w).numpy()
        torch.testing.assert_close(gguf_reference("mxfp4", gguf_bytes), want[e], rtol=0, atol=0)
    with pytest.raises(kformats.MXFP4ScaleError, match="2\\^-28"):
        kformats.mxfp4_from_hf(blocks[0], torch.full_like(scales[0], 100))

"""tokenmill's CPU kernels against the pure-torch reference, on every variant this CPU runs.

Each variant (scalar everywhere; avx2, avxvnni and avx512 where the CPU has them; and, on an AVX2 machine, the
16-lane AVX-512 code built with AVX2 flags) multiplies every format with odd shapes (N not a whole panel, K not a whole
block), one row to many, float32 and bfloat16 activations, with and without a bias. The formats' quantizers
are checked byte for byte against the gguf package's (ggml's reference rounding).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.conftest import kernel_levels
from tokenmill import kernels
from tokenmill.kernels.formats import (
    FORMATS,
    pack,
    quantize_activations,
    quantize_q4_0,
    quantize_q8_0,
    reference_linear,
    unpack,
)
from tokenmill.kernels.isa import supported_levels
from tokenmill.kernels.kformats import KSPECS, QUANTIZABLE

SHAPES = [(16, 32), (37, 70), (80, 96), (130, 257)]  # (N, K): partial panels, K not a multiple of 32
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17]  # every tile up to 8 rows, 12, the 16-row pair tile, 17 as 9 + 8
# the formats `pack` quantizes float weights to (IQ4 comes from GGUF files only: tests/unit/test_kformats.py)
PACKED = [f for f in FORMATS if f not in KSPECS or f in QUANTIZABLE]


# Each linear path on every row count: a dense format's register tiles or cache-blocked GEMM (linear/blocked.h); bf16's
# pair tiles (bf16 activations read in k pairs: vdpbf16ps on AVX-512 BF16, the same sums in FMAs elsewhere); the
# quantized formats have one integer path (linear/quant.h) for every row count.
# The AMX tiles (linear/amx.h, arch/amx/) take bf16 pairs and quantized blocks from one row where the CPU has AMX; 33
# and 40 rows fill two row blocks.
PATHS = [("bf16", "tiles"), ("bf16", "pairs"), ("bf16", "amx"), ("bf16", "blocked"), ("f32", "tiles"),
         ("f32", "blocked"), ("q8_0", "int"), ("q4_0", "int"), ("q8_0", "amx"), ("q4_0", "amx")]  # fmt: skip
NO_AMX = "no AMX tiles here: the CPU lacks AMX-BF16/INT8, the variant is not avx512bf16, or Linux refused"


@contextmanager
def _path(ops: kernels.Kernels, path: str) -> Iterator[None]:
    if path == "amx" and not ops.module.amx_native():
        pytest.skip(NO_AMX)
    blocked = ops.module.set_blocked_rows(1 if path == "blocked" else 1 << 40)
    pairs = ops.module.set_bf16_dot(1 if path in ("pairs", "amx") else 0)
    amx = ops.module.set_amx(1 if path == "amx" else 0)
    try:
        yield
    finally:
        ops.module.set_blocked_rows(blocked)
        ops.module.set_bf16_dot(pairs)
        ops.module.set_amx(amx)


@pytest.mark.parametrize(("fmt", "path"), PATHS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_linear_equals_the_reference(ops: kernels.Kernels, fmt: str, path: str, n: int, k: int) -> None:
    extra = {"amx": [33, 40], "blocked": [9, 10, 11, 23]}.get(path, [])  # blocked.h's row tiles of 12: 9-11 left
    with _path(ops, path):
        _check_linear(ops, fmt, n, k, ROWS + extra)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("half_width", [True, False])
def test_few_rows_on_either_tile_width(ops: kernels.Kernels, fmt: str, half_width: bool) -> None:
    """1-3 rows take the ymm tiles on a Zen 4 and the zmm ones elsewhere (core/cpu.h: amd_half_width_512; the AVX-512
    VNNI variants): each path on every CPU, whichever this one is (a switch elsewhere: the same tiles twice)."""
    before = ops.module.set_half_width(half_width)
    try:
        _check_linear(ops, fmt, 37, 300, [1, 2, 3, 4])
    finally:
        ops.module.set_half_width(before)


@pytest.mark.parametrize("fmt", PACKED)
def test_blocked_gemm_across_its_row_and_k_blocks(ops: kernels.Kernels, fmt: str) -> None:
    # by default thresholds, more rows than one row block (linear/blocked.h: 192, linear/quant.h: 64) and K over
    # two k blocks (256) with a tail
    _check_linear(ops, fmt, 70, 600, [200])


@pytest.mark.parametrize(("fmt", "path"), [("bf16", "pairs"), ("bf16", "tiles"), ("f32", "tiles")])
def test_register_tiles_across_their_row_blocks(ops: kernels.Kernels, fmt: str, path: str) -> None:
    # the register tiles take rows in blocks of ~384 KB of x (linear/dense.h: linear_panels): at K = 4098, 40 rows are
    # more than one block (bf16 pairs: 36 rows, float32 rows: 16-22)
    with _path(ops, path):
        _check_linear(ops, fmt, 37, 4098, [40])


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0"])
def test_splitting_k_into_spans_gives_the_bits_of_one_pass(ops: kernels.Kernels, fmt: str) -> None:
    """A panel that takes several register tiles runs them span by span of K (linear/dense.h: panel_spans for bf16,
    qdot.h: qpanel for the quantized tiles of 3 or 8), its sums kept between spans: the same bits as one pass per
    tile, at row counts that make 2-8 tiles (bf16 31 with 8 lanes: a last tile of one row, which takes one pass)
    and K over several spans with a tail (bf16: 128 k pairs a span; Q8_0 15 blocks, Q4_0 28)."""
    k = 2400 if fmt == "q4_0" else 600  # bf16 300 pairs, Q8_0 19 blocks, Q4_0 75 blocks
    packed = pack(torch.randn(37, k), fmt)
    x = torch.randn(47, k)
    with _path(ops, "tiles"):
        before = ops.module.set_kspans(True)
        try:
            for rows in (4, 7, 8, 9, 11, 12, 13, 16, 17, 25, 31, 47):  # (9: 4 + 5, the 16-lane builds' one split)
                ops.module.set_kspans(True)
                spans = ops.linear(x[:rows], packed.data, packed.format_id, 37, packed.padded_in, None)
                ops.module.set_kspans(False)
                one_pass = ops.linear(x[:rows], packed.data, packed.format_id, 37, packed.padded_in, None)
                assert torch.equal(spans, one_pass), rows
                torch.testing.assert_close(spans, reference_linear(x[:rows], packed), rtol=1e-4, atol=1e-3)
        finally:
            ops.module.set_kspans(before)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_integer_sums_do_not_saturate(ops: kernels.Kernels, fmt: str) -> None:
    """The largest products the formats can hold: every weight and activation at the end of its range, with
    signs that add up. vpmaddubsw saturates 16-bit sums; the layout keeps them below it (linear/quant.h). 3 rows and 8:
    the tiles of 1-3 rows, and the wide ones (qwide.h) or zmm ones alike."""
    k = 256
    if fmt == "q4_0":
        w = torch.full((32, k), 7.0)  # the block's largest magnitude maps to q 0 (-8 d), 7 to q 15 (7 * d)
        w[:, ::32] = -8.0
        x = torch.ones(8, k)  # q 127
    else:
        w = torch.randint(0, 2, (32, k)).float() * 2 - 1  # q +-127
        x = w[:8].clone()  # row i times channel i: every product +127 * 127
    w[16:] *= -1  # the second half of the channels the other way
    packed = pack(w, fmt)
    for rows in (x[:3], x, -x):
        y = ops.linear(rows, packed.data, packed.format_id, 32, packed.padded_in, None)
        torch.testing.assert_close(y, reference_linear(rows, packed), rtol=1e-5, atol=1e-3)  # saturation: off by 100s


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1"])
def test_amx_int8_gives_the_bits_of_the_vnni_tiles(ops: kernels.Kernels, fmt: str) -> None:
    """AMX's int8 tiles sum each block (each sub-block, in the K family) exactly, then scale it as the VNNI tiles
    do: the same bits, at every row count, both row blocks and a lone last panel included."""
    if not ops.module.amx_native():
        pytest.skip(NO_AMX)
    k = 512 if fmt.endswith("_k") else 200  # two superblocks; or K padded to 224
    packed = pack(torch.randn(80, k), fmt)  # 5 panels: two pairs and one alone
    x = torch.randn(40, k)
    before = ops.module.set_amx(0)
    try:
        integer = ops.linear(x, packed.data, packed.format_id, 80, packed.padded_in, None)
        ints16 = ops.linear(x.bfloat16(), packed.data, packed.format_id, 80, packed.padded_in, None)
        ops.module.set_amx(1)
        for rows in (1, 7, 16, 17, 40):
            amx = ops.linear(x[:rows], packed.data, packed.format_id, 80, packed.padded_in, None)
            assert torch.equal(amx, integer[:rows]), rows
            assert torch.equal(ops.linear(x[:rows].bfloat16(), packed.data, packed.format_id, 80, packed.padded_in,
                                          None), ints16[:rows]), rows  # fmt: skip
    finally:
        ops.module.set_amx(before)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_every_simd_variant_gives_the_same_quantized_bits(fmt: str) -> None:
    """Every SIMD variant sums a block's products exactly and scales the sum the same way, whatever its tiles
    (AVX2's two ymm halves per panel, AVX-512 VNNI's one zmm, 1 to 40 rows): the same bits."""
    simd = [level for level in kernel_levels() if level != "scalar"]
    if len(simd) < 2:
        pytest.skip(f"one SIMD variant runs here ({simd}): nothing to compare it with")
    packed = pack(torch.randn(80, 200), fmt)
    x = torch.randn(40, 200)
    for rows in (1, 3, 4, 8, 9, 16, 40):
        outs = [kernels.variant(level).linear(x[:rows], packed.data, packed.format_id, 80, packed.padded_in, None)
                for level in simd]  # fmt: skip
        for level, out in zip(simd[1:], outs[1:], strict=True):
            assert torch.equal(out, outs[0]), (level, rows)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_quantized_row_gives_the_same_bits_alone_and_in_a_batch(ops: kernels.Kernels, fmt: str) -> None:
    """Each row is quantized and summed on its own, in exact integers: batching cannot change its output."""
    packed = pack(torch.randn(70, 300), fmt)
    x = torch.randn(37, 300)
    batch = ops.linear(x, packed.data, packed.format_id, 70, packed.padded_in, None)
    for i in (0, 5, 36):
        alone = ops.linear(x[i : i + 1], packed.data, packed.format_id, 70, packed.padded_in, None)
        assert torch.equal(alone[0], batch[i])


def test_activation_quantization_equals_the_reference(ops: kernels.Kernels) -> None:
    """Bit for bit, ties included: the row's largest magnitude 127 makes the scale 1, so x.5 is a tie (to even)."""
    x = torch.randn(9, 96) * 3
    x[0, :32] = torch.arange(32) - 15.5  # ties: -15.5 .. 15.5
    x[0, 0] = 127.0
    x[1, 32:64] = 0.0
    q, d = ops.quantize_rows(x)
    q_ref, d_ref = quantize_activations(x)
    assert torch.equal(d, d_ref) and torch.equal(q, q_ref)
    assert q[0, 1].item() == -14 and q[0, 2].item() == -14  # -14.5 and -13.5: ties to even


def test_k_quant_rows_take_one_scale_per_superblock(ops: kernels.Kernels) -> None:
    """The K-quants' rows (as ggml's Q8_K): one scale per 256 values, set by the largest of them, in each of its
    blocks of 32; bit for bit the reference's."""
    x = torch.randn(3, 512)
    x[1, 300] = 50.0  # the second superblock's largest: its scale, and only its
    q, d = ops.quantize_rows(x, 256)
    q_ref, d_ref = quantize_activations(x, 256)
    assert torch.equal(d, d_ref) and torch.equal(q, q_ref)
    assert d.shape == (3, 16) and torch.equal(d.view(3, 2, 8), d.view(3, 2, 8)[:, :, :1].expand(3, 2, 8))
    assert d[1, 8].item() == pytest.approx(50.0 / 127) and q[1, 300].item() == 127 and d[1, 0] < d[1, 8] / 5
    assert torch.equal(quantize_activations(x[:, :256], 256)[0], q[:, :256])  # superblocks apart


def test_activation_quantization_rounds_to_the_nearest_step() -> None:
    x = torch.randn(5, 96) * torch.linspace(0.01, 10, 5)[:, None]
    x[1, :32] = 0.0  # an all-zero block: scale 0, values 0
    q, d = quantize_activations(x)
    assert q.dtype == torch.int8 and d.shape == (5, 3) and d[1, 0] == 0 and not q[1, :32].any()
    assert q.abs().max() == 127 and torch.equal(q.view(5, 3, 32).abs().amax(-1) == 127, d > 0)
    err = (q.float().view(5, 3, 32) * d[..., None] - x.view(5, 3, 32)).abs()
    assert torch.all(err <= d[..., None] * (0.5 + 1e-5))


def _check_linear(ops: kernels.Kernels, fmt: str, n: int, k: int, row_counts: list[int]) -> None:
    torch.manual_seed(n * k)
    packed = pack(torch.randn(n, k), fmt)
    bias = torch.randn(n)
    for rows in row_counts:
        x = torch.randn(rows, k)
        for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2)):
            xd = x.to(dtype)
            ref = reference_linear(xd, packed)  # float32 [rows, n]: what the kernel must compute
            for b in (None, bias):
                y = ops.linear(xd, packed.data, packed.format_id, n, packed.padded_in, b)
                expected = ref if b is None else ref + b
                assert y.dtype == dtype and y.shape == (rows, n)
                scale = expected.abs().max().item()
                assert (y.float() - expected).abs().max().item() <= tol * scale, (fmt, n, k, rows, dtype)


@pytest.mark.parametrize("path", ["tiles", "pairs", "blocked", "amx"])  # amx: forced on for every row count
def test_bfloat16_outputs_are_the_sums_rounded_to_nearest_even(ops: kernels.Kernels, path: str) -> None:
    """A weight that copies x's columns makes each output an exact sum, so out = x + bias in float32, then rounded
    to bfloat16 as torch rounds, ties to even and subnormals included, bit for bit, in whole panels (stored a vector
    at a time) and the partial one (N = 40: 16 + 16 + 8). x itself holds no subnormal: vdpbf16ps reads those as 0."""
    n, k = 40, 64
    w = torch.zeros(n, k)
    w[torch.arange(n), torch.arange(n) % k] = 1.0  # out[:, i] = x[:, i % k]
    packed = pack(w, "bf16")
    torch.manual_seed(0)
    x = torch.randn(17, k)
    x[0, :4] = torch.tensor([1.0, 1.0 + 2**-7, -0.0, 0.0])  # two ties, a negative zero, a subnormal sum
    x = x.bfloat16()
    bias = torch.randn(n) * 1e-3
    bias[:4] = torch.tensor([2**-8, 2**-8, 0.0, 2**-131])  # 1 + 2^-8 rounds down, 1 + 3 * 2^-8 up: to even
    with _path(ops, path):
        for rows in (1, 3, 16, 17):
            for b in (None, bias):
                y = ops.linear(x[:rows], packed.data, packed.format_id, n, packed.padded_in, b)
                sums = x[:rows, torch.arange(n) % k].float() + 0.0  # sums start from +0.0, so -0.0 comes out +0.0
                expected = (sums if b is None else sums + b).bfloat16()
                assert torch.equal(y.view(torch.int16), expected.view(torch.int16)), (path, rows, b is None)


@pytest.mark.parametrize("fmt", PACKED)
def test_unpack_equals_the_reference(ops: kernels.Kernels, fmt: str) -> None:
    packed = pack(torch.randn(37, 70), fmt)
    dense = ops.unpack(packed.data, packed.format_id, 37, packed.padded_in)
    assert torch.equal(dense[:, :70], unpack(packed))
    if packed.format not in ("q5_1", "q4_1"):  # (an affine block's min lands on its padding: the rows' is zero)
        assert not dense[:, 70:].any()  # the padded columns are zero


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_k"])
def test_rows_looked_up_in_the_panels_are_the_unpacked_rows(ops: kernels.Kernels, fmt: str) -> None:
    """unpack_rows (a packed embedding's lookup; bf16: a tied LM head's panels) gives each asked-for row as unpack
    does, in any order, repeats included, with an odd width in bf16 (a padded k pair)."""
    w = torch.randn(37, 71 if fmt == "bf16" else 256)
    packed = pack(w, fmt)
    ids = torch.tensor([36, 0, 17, 16, 17, 1])
    rows = ops.unpack_rows(packed.data, packed.format_id, 37, packed.padded_in, ids)
    assert torch.equal(rows[:, : w.shape[1]], unpack(packed)[ids])
    if fmt == "bf16":
        assert torch.equal(rows[:, :71], w.bfloat16().float()[ids])


def test_dense_formats_pack_exactly() -> None:
    w = torch.randn(37, 70)
    assert torch.equal(unpack(pack(w, "bf16")), w.bfloat16().float())
    assert torch.equal(unpack(pack(w, "f32")), w)


def _gguf_blocks(w: torch.Tensor, kind: str) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    raw = gguf.quants.quantize(w.numpy(), qtype)  # [N, blocks * bytes]
    return raw.reshape(w.shape[0], w.shape[1] // 32, -1)


def test_q8_0_matches_ggml_byte_for_byte() -> None:
    w = torch.randn(24, 128) * torch.linspace(0.01, 3, 24)[:, None]
    q, d = quantize_q8_0(w)
    blocks = _gguf_blocks(w, "q8_0")  # per block: fp16 d, then 32 int8
    assert np.array_equal(d.numpy().view(np.uint16), blocks[..., :2].copy().view(np.uint16)[..., 0])
    assert np.array_equal(q.numpy().reshape(24, 4, 32), blocks[..., 2:].view(np.int8))


def test_q4_0_matches_ggml_byte_for_byte() -> None:
    w = torch.randn(24, 128) * torch.linspace(0.01, 3, 24)[:, None]
    q, d = quantize_q4_0(w)
    blocks = _gguf_blocks(w, "q4_0")  # per block: fp16 d, then 16 bytes: element j low, element j + 16 high
    assert np.array_equal(d.numpy().view(np.uint16), blocks[..., :2].copy().view(np.uint16)[..., 0])
    nibbles = blocks[..., 2:]
    ggml_q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # [N, blocks, 32]
    assert np.array_equal(q.numpy().reshape(24, 4, 32), ggml_q)


def test_quantization_error_is_bounded_per_block() -> None:
    """Half a step for Q8_0; Q4_0's grid [-8, 7] * d ends one step short on the side opposite the largest
    magnitude, so a value there may be a whole step off. Plus, as in ggml, the scale's rounding to fp16 after
    quantizing (up to 2^-11 of it per step of q)."""
    w = torch.randn(8, 64)
    for quantize, offset, steps in ((quantize_q8_0, 0, 0.5 + 127 / 2048), (quantize_q4_0, 8, 1.0 + 8 / 2048)):
        q, d = quantize(w)
        deq = (q.float() - offset).view(8, 2, 32) * d.float()[..., None]
        err = (deq - w.view(8, 2, 32)).abs().amax(dim=-1)
        assert torch.all(err <= d.float().abs() * (steps + 1e-3)), quantize.__name__


def test_status_names_the_active_variant_and_why() -> None:
    s = kernels.status()
    assert s["kernels"] in (*kernels.LEVELS, "pure-torch") and s["supported"][0] == "scalar" and s["why"]


# the flags /proc/cpuinfo lists for each CPU kind (the ones isa.py reads)
_BASE = {"avx2", "fma", "f16c"}
_AVX512 = _BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
CPU_KINDS = {
    "Zen 3": (_BASE, "avx2"),
    "Alder Lake": (_BASE | {"avx_vnni"}, "avxvnni"),
    "Skylake-SP": (_AVX512, "avx512"),
    "Cascade Lake / Ice Lake": (_AVX512 | {"avx512_vnni"}, "avx512vnni"),
    "Zen 4 / Sapphire Rapids": (_AVX512 | {"avx512_vnni", "avx512_bf16", "avx_vnni"}, "avx512bf16"),
}


@pytest.mark.parametrize("kind", sorted(CPU_KINDS))
def test_each_cpu_kind_gets_its_variant(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variant picked from a CPU's flags: AVX-512 VNNI without BF16 (Cascade Lake, Ice Lake) takes the zmm
    VNNI tiles of `avx512vnni`, not `avx512`'s; BF16 with VNNI takes `avx512bf16`."""
    from tokenmill.kernels import isa

    flags, want = CPU_KINDS[kind]
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("TOKENMILL_ISA", raising=False)
    assert isa.choose().level == want
    assert isa.supported_levels()[-1] == want


def test_a_forced_isa_must_exist_and_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.kernels.isa import choose

    monkeypatch.setenv("TOKENMILL_ISA", "scalar")
    assert choose().level == "scalar" and "forced" in choose().reason
    monkeypatch.setenv("TOKENMILL_ISA", "sse9")
    allowed = "allowed: scalar, avx2, avxvnni, avx512, avx512vnni, avx512bf16"
    with pytest.raises(ValueError, match=f"TOKENMILL_ISA='sse9' is not a kernel variant; {allowed}"):
        choose()
    if "avx512" not in supported_levels():
        monkeypatch.setenv("TOKENMILL_ISA", "avx512")
        with pytest.raises(ValueError, match="needs CPU features this CPU lacks"):
            choose()


def test_the_avxvnni_variant_builds_where_the_cpu_lacks_it() -> None:
    """The AVX-VNNI variant (Intel's client cores from Alder Lake on) compiles and loads on every x86 machine, so
    its VEX vpdpbusd is built by every CI run; where the CPU has AVX-VNNI (Sapphire Rapids, Zen 5), the `ops`
    fixture runs its kernels against the reference like every other variant's."""
    import platform

    from tokenmill.kernels.build import load

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AVX-VNNI is an x86 extension")
    if "avxvnni" in supported_levels():
        pytest.skip("this CPU has AVX-VNNI: the ops fixture tests the variant's kernels themselves")
    assert load("avxvnni").lanes == 8


def test_a_build_killed_midway_does_not_hang_the_next_start() -> None:
    """A build killed by a signal leaves torch's baton (a `lock` file in the build directory) behind; torch's
    loader then waited for it forever, in every later process, even with the module built. The next start
    must load the variant and clear the baton."""
    from tokenmill.kernels.build import build_key, cache_root, load
    from tokenmill.kernels.isa import LANES

    load("scalar")  # built (or found) here, so the child below only has to load it
    baton = cache_root() / build_key("scalar") / "lock"
    baton.touch()  # what a build killed mid-compile leaves
    code = "from tokenmill.kernels.build import load; print(load('scalar').lanes)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        baton.unlink(missing_ok=True)
        pytest.fail("loading a built variant hung on a stale build lock")
    assert done.returncode == 0 and done.stdout.strip() == str(LANES["scalar"]), done.stderr
    assert not baton.exists()


def test_two_installs_of_the_same_sources_build_in_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch writes the sources' paths into a build folder's build.ninja, so two installs of the same sources (two
    venvs, a clone beside a wheel) that shared a folder recompiled there each time the other had loaded. Each
    source folder gets its own build; the same folder keeps its key. The packed weights' layout is the sources'
    alone (layout_key), so the two share their packed-weight cache instead of packing again at each start."""

    from tokenmill.kernels import build

    here, layout = build.build_key("scalar"), build.layout_key("scalar")
    assert build.build_key("scalar") == here
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    assert build.build_key("scalar") != here
    assert build.layout_key("scalar") == layout


def test_a_built_variant_loads_without_torchs_build_machinery_and_a_damaged_one_is_built_again(
    tmp_path: Path,
) -> None:
    """A start with the variant built imports the module itself: torch's cpp_extension (and setuptools, 0.4-0.6 s)
    stays out. A module that does not import (a link cut short) is built again."""
    from tokenmill.kernels.build import build_key, cache_root, load
    from tokenmill.kernels.isa import LANES

    load("scalar")
    folder = tmp_path / "kernels" / build_key("scalar")
    shutil.copytree(cache_root() / build_key("scalar"), folder)
    code = ("import sys; from tokenmill.kernels.build import load; m = load('scalar'); "
            "print(m.lanes, 'torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")  # fmt: skip
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == [str(LANES["scalar"]), "False", "False"], done.stderr
    (so,) = folder.glob("*.so")
    so.write_bytes(so.read_bytes()[:4096])  # what a link killed midway leaves
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split()[0] == str(LANES["scalar"]), done.stderr
    assert so.stat().st_size > 4096


def test_without_a_compiler_the_pure_torch_path_runs_and_says_so_once(tmp_path: Path) -> None:
    """A machine with no C++ compiler (and nothing cached) still generates, and one stderr line says why."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TOKENMILL_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "tokenmill", "generate", "--prompt", "Hello", "--max-tokens", "4", "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"finish_reason": "length"' in done.stdout
    notes = [line for line in done.stderr.splitlines() if "kernels" in line]
    assert len(notes) == 1 and "no C++ compiler" in notes[0] and "pure-torch path" in notes[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_cache_folder_that_cannot_be_made_leaves_the_pure_torch_path_and_one_line(tmp_path: Path) -> None:
    """TOKENMILL_CACHE_DIR (or the home) where no folder can be made: tokenmill still runs, and says why once."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(blocker / "cache")}
    done = subprocess.run([sys.executable, "-m", "tokenmill", "env"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())
    assert lines["kernels"] == "pure-torch" and "cannot create the kernel cache" in lines["why"]
    notes = [line for line in done.stderr.splitlines() if "kernel cache" in line]
    assert len(notes) == 1 and "TOKENMILL_CACHE_DIR" in notes[0], done.stderr


def test_a_variant_that_does_not_build_gives_way_to_the_next_lower_one(tmp_path: Path) -> None:
    """A compiler that refuses the best variant's flags (too old for them) leaves the next lower variant running,
    not the pure-torch path, and one stderr line says so."""
    from tokenmill.kernels.isa import COMPILE_FLAGS

    levels = supported_levels()
    if len(levels) < 2:
        pytest.skip("this CPU runs the portable variant only: there is no lower one to fall back to")
    best, lower = levels[-1], levels[-2]
    flag = sorted(set(COMPILE_FLAGS[best]) - set(COMPILE_FLAGS[lower]))[0]  # what only the best variant asks for
    # the lower variant as the session's cache holds it (built by now or here): only the best one is built again
    from tokenmill.kernels import build

    kernels.variant(lower)
    key = build.build_key(lower)
    shutil.copytree(build.cache_root() / key, tmp_path / "cache" / "kernels" / key)
    cxx = tmp_path / "old-c++"
    cxx.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{flag}" ] && exit 1; done\nexec c++ "$@"\n')
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "TOKENMILL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TOKENMILL_ISA", None)
    done = subprocess.run([sys.executable, "-m", "tokenmill", "env"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())
    assert lines["kernels"] == lower and f"the {best} kernels could not be built" in lines["why"]
    notes = [line for line in done.stderr.splitlines() if "could not be built" in line]
    assert len(notes) == 1 and f"running the {lower} kernels" in notes[0], done.stderr


def test_env_names_the_path_and_the_thread_policy() -> None:
    """`tokenmill env` says which kernels run and why; tokenmill asks OpenMP not to spin unless told otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-m", "tokenmill", "env"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())
    assert lines["kernels"] in (*kernels.LEVELS, "pure-torch") and lines["why"]
    assert "'OMP_WAIT_POLICY': 'PASSIVE'" in lines["environment"]
    mine = subprocess.run([sys.executable, "-m", "tokenmill", "env"], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "'OMP_WAIT_POLICY': 'ACTIVE'" in mine.stdout

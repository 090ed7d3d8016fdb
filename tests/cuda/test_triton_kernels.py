"""The GPU's Triton kernels (kernels/cuda/) against the torch code they replace.

On a GPU they run compiled (scripts/test_cuda.sh); without one, on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, set here before the kernels are defined). CI's CPU install has no Triton (a 290 MB wheel that
only GPU users need), so there these tests skip, saying so; `pip install triton` runs them on any machine.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit defines the kernels
pytest.importorskip("triton", reason="Triton is not installed (CPU installs leave it out; `pip install triton`)")

from tokenmill.attention.backend import attend_sequence
from tokenmill.attention.sinks import attend_with_sinks
from tokenmill.kernels import formats
from tokenmill.kernels.cuda import CudaKernels
from tokenmill.models.rope import apply_rotary

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OPS = CudaKernels()
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Triton's interpreter casts float32 to bfloat16 by truncation (triton/runtime/interpreter.py), a GPU rounds to
# nearest as torch does: bit-equal roundings are checked where the kernels are compiled, 1e-2 close elsewhere
EXACT_BF16 = DEV == "cuda"


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _torch_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # HF's: rounded, then weighted
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_and_the_residual_add_match_torch(dtype: torch.dtype, with_residual: bool) -> None:
    x, w = _randn(5, 96, dtype=dtype), _randn(96, dtype=dtype, seed=1)
    residual = _randn(5, 96, dtype=dtype, seed=2) if with_residual else None
    stream = x + residual if residual is not None else x
    want = _torch_rmsnorm(stream, w, 1e-6)
    got = OPS.rmsnorm(x, residual, w, 1e-6)
    if residual is not None:  # the residual stream, updated in place, rounded as torch's add
        assert (
            torch.equal(residual, stream)
            if EXACT_BF16 or dtype == torch.float32
            else torch.allclose(residual, stream, **TOL[dtype])
        )
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    gate_up = _randn(3, 2 * 1100, dtype=dtype)  # 1100 columns: two column blocks, the second ragged
    gate, up = gate_up.split(1100, dim=-1)
    torch.testing.assert_close(OPS.silu_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_mul_matches_torch(dtype: torch.dtype, approximate: str) -> None:
    gate_up = 3 * _randn(3, 2 * 1100, dtype=dtype)  # wide enough to reach gelu's tails
    gate, up = gate_up.split(1100, dim=-1)
    want = F.gelu(gate, approximate=approximate) * up
    torch.testing.assert_close(OPS.gelu_mul(gate_up, tanh=approximate == "tanh"), want, **TOL[dtype])
    assert not torch.allclose(OPS.gelu_mul(gate_up, tanh=approximate != "tanh"), want, atol=1e-6, rtol=0)


def _rotary_tables(t: int, dh: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(t, dtype=torch.float32, device=DEV)[:, None] * torch.linspace(0.1, 1, dh // 2, device=DEV)
    return torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norms", [False, True])
def test_rope_and_kv_write_in_one_launch_match_the_ops_they_replace(dtype: torch.dtype, norms: bool) -> None:
    """GQA (6 q heads on 2 KV heads), head_dim 40 (a half of 20: masked lanes); with Qwen3's q/k norms or none."""
    t, h, hkv, dh = 3, 6, 2, 40
    qkv = _randn(t, (h + 2 * hkv) * dh, dtype=dtype)
    cos, sin = _rotary_tables(t, dh, dtype)
    qw, kw = 1 + _randn(dh, dtype=dtype, seed=1) / 4, 1 + _randn(dh, dtype=dtype, seed=2) / 4
    q, k, v = (x.view(t, -1, dh) for x in qkv.split([h * dh, hkv * dh, hkv * dh], dim=-1))
    if norms:
        q, k = _torch_rmsnorm(q, qw, 1e-6), _torch_rmsnorm(k, kw, 1e-6)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    slots = torch.tensor([9, 2, 4], device=DEV)
    want = torch.zeros(2, 12, hkv, dh, dtype=dtype, device=DEV)
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    v_before = v.clone()
    cache = torch.zeros_like(want)
    OPS.rope_kv_write_(qkv, cos, sin, h, dh, cache, slots, (qw, kw, 1e-6) if norms else None)
    torch.testing.assert_close(cache, want, **TOL[dtype])
    torch.testing.assert_close(qkv[:, : h * dh].view(t, h, dh), q, **TOL[dtype])  # q rotated in place
    torch.testing.assert_close(qkv[:, h * dh : (h + hkv) * dh].view(t, hkv, dh), k, **TOL[dtype])
    assert torch.equal(qkv[:, (h + hkv) * dh :].view(t, hkv, dh), v_before)  # v as it was
    assert cache[:, [0, 1, 3, 5, 6, 7, 8, 10, 11]].abs().sum() == 0  # no other slot written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_the_q_and_k_heads_of_a_fused_qkv_in_place(dtype: torch.dtype) -> None:
    t, h, hkv, dh = 4, 3, 1, 32
    qkv = _randn(t, (h + 2 * hkv) * dh, dtype=dtype)
    angles = torch.arange(t, dtype=torch.float32, device=DEV)[:, None] * torch.linspace(0.1, 1, dh // 2, device=DEV)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    want = qkv.clone()
    heads = want[:, : (h + hkv) * dh].view(t, h + hkv, dh)
    want[:, : (h + hkv) * dh] = apply_rotary(heads, cos, sin).reshape(t, -1)
    OPS.rope_(qkv, cos, sin, h + hkv, dh)
    torch.testing.assert_close(qkv, want, **TOL[dtype])
    assert torch.equal(qkv[:, (h + hkv) * dh :], want[:, (h + hkv) * dh :])  # v untouched


def test_kv_write_puts_strided_rows_at_their_slots() -> None:
    t, hkv, dh = 3, 2, 16
    qkv = _randn(t, (4 + 2 * hkv) * dh)
    k = qkv[:, 4 * dh : (4 + hkv) * dh].view(t, hkv, dh)
    v = qkv[:, (4 + hkv) * dh :].view(t, hkv, dh)
    cache = torch.zeros(2, 10, hkv, dh, device=DEV)
    slots = torch.tensor([7, 0, 3], device=DEV)
    OPS.kv_write(k, v, cache, slots)
    want = torch.zeros_like(cache)
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    assert torch.equal(cache, want)


def _reference_attention(q, cache, tables, lens, bs, window):  # type: ignore[no-untyped-def]
    """Each sequence's positions gathered through its table, then SDPA in float32 (GQA by repeating keys)."""
    out = []
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n, device=DEV)
        slots = tables[i, pos // bs] * bs + pos % bs
        k, v = cache[0, slots].float(), cache[1, slots].float()  # [n, Hkv, Dh]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0])  # [H, Dh]
    return torch.stack(out)


@pytest.mark.parametrize(
    "b, h, hkv, dh, window",
    [(3, 8, 2, 64, None), (1, 7, 1, 80, None), (2, 4, 4, 32, 5), (1, 2, 1, 64, 37), (140, 4, 2, 16, None)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_sdpa(
    b: int, h: int, hkv: int, dh: int, window: int | None, dtype: torch.dtype
) -> None:
    """GQA groups of 4, 7 (not a power of two) and 1; head sizes 80 (padded to 128) and 16; windows; one sequence
    (the context split over many programs, then combined) and 140 (one split each); contexts of 1 position, ragged
    block ends and tiles spanning blocks, through tables in shuffled block order."""
    bs, width = 16, 9
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 64 * bs, hkv, dh, generator=g).to(dtype).to(DEV)
    tables = torch.stack([torch.randperm(64, generator=g)[:width] for _ in range(b)]).to(DEV)
    lens = torch.tensor([[1, 17, 140, 144, 33][i % 5] for i in range(b)], device=DEV)
    q = torch.randn(b, h, dh, generator=g).to(dtype).to(DEV)
    got = OPS.decode_attention(q, cache, tables, lens, bs, window)
    want = _reference_attention(q, cache, tables, lens, bs, window).to(dtype)
    torch.testing.assert_close(got, want, **(TOL[dtype] if dtype != torch.float32 else dict(atol=2e-6, rtol=1e-5)))


@pytest.mark.parametrize("b, window", [(1, None), (1, 20), (140, None), (140, 7)])
def test_paged_decode_attention_with_sinks_matches_the_torch_path(b: int, window: int | None) -> None:
    """gpt-oss's sinks (a logit per query head in the denominator, attention/sinks.py): one sequence (many splits,
    the sink joining in the combine) and 140 (2 x 140 programs fill the GPU: one split each, the sink in the
    epilogue), with and without a window; sinks from far below the scores to far above them."""
    h, hkv, dh, bs, width = 8, 2, 32, 16, 9
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 64 * bs, hkv, dh, generator=g).to(DEV)
    tables = torch.stack([torch.randperm(64, generator=g)[:width] for _ in range(b)]).to(DEV)
    lens = torch.tensor([[140, 1, 17, 144, 33][i % 5] for i in range(b)], device=DEV)
    q = torch.randn(b, h, dh, generator=g).to(DEV)
    sinks = torch.tensor([-30.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, 30.0], device=DEV)
    got = OPS.decode_attention(q, cache, tables, lens, bs, window, sinks)
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n, device=DEV)
        slots = tables[i, pos // bs] * bs + pos % bs
        keys, values = cache[0, slots].transpose(0, 1)[None], cache[1, slots].transpose(0, 1)[None]  # [1, Hkv, n, Dh]
        want = attend_with_sinks(q[i].view(1, hkv, h // hkv, 1, dh), keys, values, sinks).view(h, dh)
        torch.testing.assert_close(got[i], want, atol=2e-6, rtol=1e-5)
    without = OPS.decode_attention(q, cache, tables, lens, bs, window)
    assert not torch.allclose(got[:, 1:], without[:, 1:], atol=1e-3)  # (head 0's sink, -30, weighs ~nothing)


@pytest.mark.parametrize(
    "h, hkv, dh, window, sinks",
    [(4, 2, 32, None, False), (6, 1, 80, None, False), (4, 4, 16, 7, False), (8, 2, 32, 12, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_matches_the_per_sequence_path(
    h: int, hkv: int, dh: int, window: int | None, sinks: bool, dtype: torch.dtype
) -> None:
    """Four prompts in one call, after two decode rows: a fresh one of 70 tokens (three query tiles), a chunk of
    5 after 40 cached, one token after 1, a chunk of 33 after 64 (a tile of one row past 32); GQA 2, 6 and 1,
    head sizes 32, 80 (padded to 128) and 16, windows, sinks; tables in shuffled block order. Each sequence
    against attend_sequence over its gathered context (the path the loop took)."""
    bs, g = 8, torch.Generator().manual_seed(7)
    spans = [(70, 70), (5, 45), (1, 2), (33, 97)]  # (new tokens, context length)
    width = max(-(-ctx // bs) for _, ctx in spans)
    cache = torch.randn(2, 64 * bs, hkv, dh, generator=g).to(dtype).to(DEV)
    tables = torch.stack([torch.randperm(64, generator=g)[:width] for _ in spans]).to(DEV)
    rows = 2 + sum(n for n, _ in spans)
    qkv = torch.randn(rows, (h + 2 * hkv) * dh, generator=g).to(dtype).to(DEV)  # q rows strided, as in a layer
    q = qkv[:, : h * dh].view(rows, h, dh)
    starts = [2 + sum(n for n, _ in spans[:i]) for i in range(len(spans))]
    seqs = torch.tensor([[s, n, ctx] for s, (n, ctx) in zip(starts, spans, strict=True)], device=DEV)
    sink = torch.linspace(-2, 3, h, device=DEV) if sinks else None
    out = torch.full((rows, h, dh), 7.0, dtype=dtype, device=DEV)
    OPS.prefill_attention(q, cache, tables, seqs, bs, window, out, sink, max_rows=70)
    assert (out[:2] == 7.0).all()  # the decodes' rows untouched
    for i, ((n, ctx), start) in enumerate(zip(spans, starts, strict=True)):
        pos = torch.arange(ctx, device=DEV)
        slots = tables[i, pos // bs] * bs + pos % bs
        keys, values = cache[0, slots].transpose(0, 1), cache[1, slots].transpose(0, 1)  # [Hkv, ctx, Dh]
        want = attend_sequence(q[start : start + n].float(), keys.float(), values.float(), window, sink)
        tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out[start : start + n].float(), want, **tol)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 70])
@pytest.mark.parametrize("k, kx", [(256, 256), (160, 160), (256, 230), (2048, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_the_dequantized_product(m: int, k: int, kx: int, dtype: torch.dtype) -> None:
    """Q8_0 weights (int8, one scale per 32) read as int8: every row count (the GEMV up to 4 rows, the tiles above;
    split K for few rows), K in groups of 128 or of 32, and activations narrower than the padded weight."""
    n = 96
    q, d = formats.quantize_q8_0(torch.randn(n, k, generator=torch.Generator().manual_seed(4)))
    q, d = q.to(DEV), d.float().to(DEV)
    x, bias = _randn(m, kx, dtype=dtype, seed=5), _randn(n, seed=6)
    w = (q.float().view(n, -1, 32) * d[..., None]).view(n, k)[:, :kx]
    want = (x.float() @ w.T + bias).to(dtype)
    got = OPS.q8_linear(x, q, d, bias, torch.empty(m, n, dtype=dtype, device=DEV))
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 2, 8), (5, 3, 6), (37, 2, 8), (40, 4, 5)])
def test_align_lays_each_experts_pairs_in_blocks_of_their_own(tokens: int, top_k: int, experts: int) -> None:
    """Every pair once, in a block of its expert's, the blocks each expert needs and no more (a device computation:
    no host sync, so a CUDA graph records it)."""
    from tokenmill.kernels.cuda import moe

    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEV)
    slots, block_expert, blocks = moe.align(ids, experts)
    pairs = tokens * top_k
    flat = ids.flatten().cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert blocks.item() == int(((counts + moe.BM - 1) // moe.BM).sum())
    used = slots[: blocks.item() * moe.BM].cpu().view(-1, moe.BM)
    assert sorted(used[used < pairs].tolist()) == list(range(pairs))
    assert not (slots[blocks.item() * moe.BM :] < pairs).any()
    for b, row in enumerate(used):
        assert (flat[row[row < pairs]] == block_expert[b].item()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (7, 2), (33, 3)])
def test_fused_moe_is_each_chosen_experts_swiglu_times_its_weight(dtype: torch.dtype, tokens: int, top_k: int) -> None:
    experts, d, inter = 6, 64, 48
    g = torch.Generator().manual_seed(3)
    x = _randn(tokens, d, dtype=dtype, seed=7)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEV)
    weights = torch.rand(tokens, top_k, generator=g).to(DEV)
    w1 = (_randn(experts, 2 * inter, d, seed=8) * 0.2).to(dtype)
    w2 = (_randn(experts, d, inter, seed=9) * 0.2).to(dtype)
    got = OPS.fused_moe(x, ids, weights, w1, w2)  # [T * k, D] float32
    want = torch.empty(tokens * top_k, d)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j].item()
            gate, up = (x[t].float() @ w1[e].float().T).to(dtype).float().split(inter)
            act = (F.silu(gate.to(dtype)).float() * up).to(dtype).float()
            want[t * top_k + j] = weights[t, j].item() * (act @ w2[e].float().T)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(1, 896), (3, 2500), (4, 40)])
def test_fp8_rows_quantize_the_activations_as_the_torch_path(dtype: torch.dtype, m: int, k: int) -> None:
    """`Fp8Linear`'s activations in one launch: the scales of `quantize_rows` (an all-zero row's 1 too), and its
    float8 values (rows wider than a block, a row narrower than one)."""
    from tokenmill.models.gpu_linear import quantize_rows

    x = _randn(m, k, dtype=dtype, seed=k) * 3
    if m > 1:
        x[1] = 0
    q, scale = OPS.fp8_rows(x)
    want_q, want_scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and torch.equal(scale, want_scale)
    if DEV == "cuda":
        assert torch.equal(q.float(), want_q.float())
    else:  # Triton's interpreter casts to float8 by truncation, and a value that rounds up to a power of two
        # (127.9 -> 128) comes out half of it (64): one e4m3 step apart at most, but at those
        got, want = q.float(), want_q.float()
        carried = torch.frexp(want)[0].abs() == 0.5  # torch's result a power of two
        assert ((got - want).abs() <= want.abs() / 8 + 2**-9)[~carried].all()
        assert (got == want).float().mean() > 0.5

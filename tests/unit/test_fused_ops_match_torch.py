"""The fused decode ops (residual add + RMSNorm, RoPE, SiLU·mul, the argmax, the KV write), the grammar bitmask and
the MLPs' shared scratch, against the torch code they replace, on every kernel variant this CPU runs."""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_rmsnorm_equals_torch_with_and_without_residual(ops: kernels.Kernels, dtype: torch.dtype, tol: float) -> None:
    from tokenmill.models.layers import RMSNorm

    norm = RMSNorm(200, 1e-6).to(dtype)
    norm.weight.data = torch.randn(200).to(dtype)
    x, residual = torch.randn(5, 200).to(dtype), torch.randn(5, 200).to(dtype)
    torch.testing.assert_close(ops.rmsnorm(x, None, norm.weight, 1e-6), norm(x), atol=tol, rtol=tol)
    mine = residual.clone()
    out = ops.rmsnorm(x, mine, norm.weight, 1e-6)
    assert torch.equal(mine, x + residual)  # the residual stream, updated in place, rounded like torch's add
    torch.testing.assert_close(out, norm(x + residual), atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_rope_in_place_on_fused_rows_equals_torch_and_leaves_v(
    ops: kernels.Kernels, dtype: torch.dtype, tol: float
) -> None:
    from tokenmill.model_config import RopeConfig
    from tokenmill.models.rope import RotaryEmbedding, apply_rotary

    heads, kv_heads, dh, t = 4, 2, 48, 7
    cos, sin = RotaryEmbedding(RopeConfig(theta=500.0), dh)(torch.arange(3, 3 + t), dtype)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dh).to(dtype)  # q | k | v columns
    q, k = qkv[:, : heads * dh].view(t, heads, dh), qkv[:, heads * dh : (heads + kv_heads) * dh].view(t, kv_heads, dh)
    expected_q, expected_k, v_before = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), qkv[:, -kv_heads * dh :]
    v_before = v_before.clone()
    ops.rope_(qkv, cos, sin, heads + kv_heads, dh)
    torch.testing.assert_close(q, expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, expected_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, -kv_heads * dh :], v_before)  # v untouched


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_silu_mul_equals_torch_at_its_extremes(ops: kernels.Kernels, dtype: torch.dtype, tol: float) -> None:
    gate_up = (torch.randn(6, 2 * 70) * 3).to(dtype)
    gate_up[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -88.0, 30.0])  # exp's clamp, 0, both signs' far ends
    gate_up[1, 3] = float("nan")  # a NaN gate stays a NaN (the bf16 rounding's slow path)
    gate, up = gate_up.split(70, dim=-1)
    out, expected = ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol, equal_nan=True)
    assert out[1, 3].isnan()
    assert out[0, 0] == 0 and out[0, 0].signbit() == expected[0, 0].signbit()  # e^100 overflows: -0 * up, as torch


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("width", [70, 16])  # 70: a tail past the vector lanes
def test_clamped_swiglu_equals_torch_across_its_clamps(ops: kernels.Kernels, dtype: torch.dtype, tol: float,
                                                       width: int) -> None:  # fmt: skip
    """gpt-oss's clamped SwiGLU (ops/fused.h) against the module path's torch ops: gate clamped above at the limit,
    up to [-limit, limit], (up + 1) * gate * sigmoid(alpha gate); values far past both clamps and at exp's ends."""
    alpha, limit = 1.702, 7.0
    gate_up = (torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(width)) * 6).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -60.0, limit, -limit])
    gate_up[1, width : width + 4] = torch.tensor([-100.0, 100.0, limit, -limit])
    gate, up = gate_up.split(width, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    expected = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    torch.testing.assert_close(ops.clamped_swiglu(gate_up, alpha, limit), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("v", [5, 16, 100, 4099])  # under one vector, whole vectors, a tail
def test_argmax_equals_torch(ops: kernels.Kernels, v: int) -> None:
    """The first of equal maxima, the first NaN, all -inf, and maxima in the vector part and in the tail."""
    x = torch.randn(7, v)
    x[1] = x[1].round()  # many ties
    x[1, v // 2 :] = x[1].max()
    x[2] = float("-inf")
    x[3, v - 1] = 1e9  # the last element (the tail where v is not whole vectors)
    x[4, v // 3] = float("nan")
    x[4, v - 1] = float("nan")
    x[5, 0] = x[5, -1] = 1e9  # the first of two, across the vector and the tail
    for rows in (x, x[:1], x[2:4]):
        assert torch.equal(ops.argmax(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
def test_kv_write_puts_strided_rows_in_their_slots(ops: kernels.Kernels, dtype: torch.dtype, tol: float) -> None:
    qkv = torch.randn(3, (2 + 2 * 2) * 16).to(dtype)
    k, v = qkv[:, 32:64].view(3, 2, 16), qkv[:, 64:].view(3, 2, 16)
    cache = torch.zeros(2, 20, 2, 16, dtype=dtype)
    slots = torch.tensor([7, 0, 19], dtype=torch.int64)
    ops.kv_write(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    expected[0].index_copy_(0, slots, k)
    expected[1].index_copy_(0, slots, v)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("vocab", [1, 31, 70, 151936])
def test_the_grammar_bitmask_equals_the_reference(ops: kernels.Kernels, vocab: int) -> None:
    """The kernel masks in place what `sampling.apply_bitmask` masks: random words, all-ones (free) rows, and a
    mask narrower than the vocabulary (tokens past it are banned)."""
    from tokenmill.sampling.sampler import apply_bitmask

    gen = torch.Generator().manual_seed(vocab)
    for words in ((vocab + 31) // 32, max(1, vocab // 64)):
        logits = torch.randn(3, vocab, generator=gen)
        mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
        mask[1] = -1  # a free row
        want = apply_bitmask(logits, mask)
        got = logits.clone()
        ops.apply_bitmask(got, mask)
        assert torch.equal(got, want)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_mlps_reuse_one_scratch_and_their_outputs_do_not_change(ops: kernels.Kernels, quantization: str) -> None:
    """The MLPs of a model write their [T, 2I] and [T, I] intermediates into buffers they share (layers.Scratch),
    grown to the most rows seen: the outputs are those of fresh tensors, bit for bit, at every row count."""
    from types import SimpleNamespace

    from torch import nn

    from tokenmill.models.layers import GatedMLP, bind_kernels
    from tokenmill.models.linear import prepare_linears

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu", mlp_bias=False)
    torch.manual_seed(0)
    model = nn.Sequential(GatedMLP(cfg), GatedMLP(cfg)).to(torch.bfloat16)  # type: ignore[arg-type]
    prepare_linears(model, quantization, torch.device("cpu"))
    bind_kernels(model, ops)
    first, second = model[0], model[1]
    assert first.scratch is not None and first.scratch is second.scratch
    for rows in (40, 3, 41, 40):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        for mlp in (first, second):
            fresh = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(x)))
            assert torch.equal(mlp(x), fresh)
    buf = first.scratch.get("gate_up", 41, 192, torch.bfloat16)
    assert first.scratch.get("gate_up", 3, 192, torch.bfloat16).data_ptr() == buf.data_ptr()  # reused, not new


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_a_long_prefill_goes_through_the_mlp_in_row_blocks(ops: kernels.Kernels, quantization: str) -> None:
    """Rows beyond `block_rows` go through in blocks (a long prefill's intermediates stay small): the output is the
    one-call output bit for bit, a short last block included, and the scratch holds one block's rows only."""
    from types import SimpleNamespace

    from tokenmill.models.layers import GatedMLP, bind_kernels
    from tokenmill.models.linear import prepare_linears

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu", mlp_bias=False)
    torch.manual_seed(0)
    mlp = GatedMLP(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    prepare_linears(mlp, quantization, torch.device("cpu"))
    bind_kernels(mlp, ops)
    assert mlp.scratch is not None and mlp.block_rows >= 64
    x = torch.randn(150, 64).to(torch.bfloat16)
    whole = mlp(x)  # [150, 64] in one call
    mlp.block_rows = 32
    mlp.scratch.clear()
    blocks = mlp(x)  # 4 blocks of 32 rows and one of 22
    assert torch.equal(blocks, whole)
    assert mlp.scratch.get("gate_up", 1, 192, torch.bfloat16).untyped_storage().nbytes() == 32 * 192 * 2

"""The linear kernels: packed, int8 and int4 weight-only modules against plain math on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.linear import (
    DEQUANT_ABOVE_ROWS,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    packing_unsupported,
    prepare_linears,
    quantize_int8,
    weight_bytes,
)


def _linear(k: int, n: int, dtype: torch.dtype, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_packed_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    if (reason := packing_unsupported(dtype)) is not None:
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU: {reason}")
    lin = _linear(96, 80, dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(PackedLinear(lin)(x), lin(x), atol=tol, rtol=tol)
    torch.testing.assert_close(PackedLinear(lin)(x.view(rows, 1, 96)), lin(x).view(rows, 1, 80), atol=tol, rtol=tol)


def test_packing_a_dtype_the_cpu_cannot_pack_is_one_clear_error() -> None:
    reason = packing_unsupported(torch.bfloat16)
    if reason is None:
        pytest.skip("this CPU packs bfloat16 weights (AVX-512 or AVX-NE-CONVERT): nothing to refuse")
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"--pack-weights cannot pack bfloat16 weights on this CPU .*--dtype float32"):
        prepare_linears(model, "none", torch.device("cpu"), pack_weights=True)
    assert prepare_linears(model, "none", torch.device("cpu"), pack_weights=False) == {}


def test_int8_quantization_error_is_bounded_per_channel() -> None:
    w = torch.randn(64, 128) * torch.linspace(0.01, 3, 64)[:, None]  # channels of very different ranges
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8
    err = (q.float() * scales[:, None] - w).abs().amax(dim=1)
    assert torch.all(err <= scales / 2 + 1e-6)  # rounding: half a step per channel


@pytest.mark.parametrize("rows", [1, DEQUANT_ABOVE_ROWS, DEQUANT_ABOVE_ROWS + 9])
def test_int8_both_paths_equal_dequantized_math(rows: int) -> None:
    lin = _linear(128, 96, torch.bfloat16)
    m = Int8Linear(lin)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    ref = F.linear(x.float(), m.qweight.float() * m.scales.float()[:, None], m.bias.float())
    torch.testing.assert_close(m(x).float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, DEQUANT_ABOVE_ROWS + 9])
def test_int4_kernel_equals_our_dequantization(rows: int) -> None:
    lin = _linear(256, 64, torch.bfloat16)
    m = Int4Linear(lin)
    w = m.dequantize(torch.float32)
    assert (w - lin.weight.float()).abs().max() < 0.6 * (lin.weight.float().abs().max() / 15 * 2)  # within a step
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(m(x).float(), F.linear(x.float(), w, m.bias.float()), atol=5e-2, rtol=3e-2)


def test_prepare_linears_swaps_every_linear_and_reports_it() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    dense = weight_bytes(model)
    assert prepare_linears(model, "int8", torch.device("cpu")) == {"int8": 2}
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert weight_bytes(model) < 0.6 * dense  # int8 weights + bf16 scales/bias vs bf16 weights
    model2 = nn.Sequential(nn.Linear(64, 64)).to(torch.float32)
    assert prepare_linears(model2, "none", torch.device("cpu")) == {"packed": 1}


def test_bad_quantization_requests_fail_clearly() -> None:
    with pytest.raises(ValueError, match="allowed: none, int8, int4"):
        prepare_linears(nn.Sequential(nn.Linear(64, 64)), "fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="int4.*bfloat16"):
        prepare_linears(nn.Sequential(nn.Linear(64, 64)), "int4", torch.device("cpu"))  # float32 model

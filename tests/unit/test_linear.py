"""The linear modules: oneDNN-packed, and tokenmill's kernel formats (bf16, Q8_0, Q4_0) on every path they take,
against plain math on the same weights; and which module each setting gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.kernels import formats
from tokenmill.models.linear import (
    KERNEL_MAX_ROWS,
    KernelLinear,
    PackedLinear,
    packing_unsupported,
    prepare_linears,
    weight_bytes,
)


def _linear(k: int, n: int, dtype: torch.dtype, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_onednn_packed_linear_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
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
    assert prepare_linears(model, "none", torch.device("cpu"), pack_weights=False) == {"bf16": 1}


def _fresh(k: int, n: int, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    return nn.Sequential(_linear(k, n, dtype), nn.ReLU(), _linear(n, 32, dtype, bias=False))


@pytest.mark.parametrize("fmt", ["bf16", "f32", "q8_0", "q4_0"])
def test_kernel_gemm_and_torch_fallback_give_the_same_product(fmt: str) -> None:
    """The kernel (up to KERNEL_MAX_ROWS rows), the unpacked GEMM above it (where oneDNN's wins), and the
    pure-torch fallback all multiply by the same packed weight."""
    lin = _linear(100, 70, torch.bfloat16)
    ops = kernels.active()
    if ops is None:
        pytest.skip(f"no compiled kernels here: {kernels.status()['why']}")
    fast, fallback = KernelLinear.from_linear(lin, fmt, ops), KernelLinear.from_linear(lin, fmt, None)
    w = formats.unpack(fast.packed())
    for rows in (1, 7, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 5):
        x = torch.randn(rows, 100, dtype=torch.bfloat16)
        ref = F.linear(x.float(), w, fast.bias)
        for module in (fast, fallback):
            y = module(x.view(rows, 1, 100))
            assert y.shape == (rows, 1, 70) and y.dtype == torch.bfloat16
            torch.testing.assert_close(y.view(rows, 70).float(), ref, atol=2e-2, rtol=2e-2)


def test_prepare_linears_swaps_every_linear_and_reports_it() -> None:
    cpu = torch.device("cpu")
    model = _fresh(64, 64)
    dense = weight_bytes(model)
    assert prepare_linears(model, "int8", cpu) == {"q8_0": 2}
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert weight_bytes(model) < 0.6 * dense  # Q8_0: 34 bytes per 32 weights (+ float32 bias) vs bf16's 64
    model = _fresh(64, 64)
    assert prepare_linears(model, "int4", cpu) == {"q4_0": 2} and weight_bytes(model) < 0.35 * dense
    assert prepare_linears(_fresh(64, 64), "none", cpu) == {"bf16": 2}
    assert prepare_linears(_fresh(64, 64), "none", cpu, cpu_kernels=False) == {}  # the switch: plain torch
    assert prepare_linears(_fresh(64, 64, torch.float32), "none", cpu) == {"f32": 2}
    assert prepare_linears(_fresh(64, 64, torch.float16), "none", cpu) == {}  # float16 stays on torch
    assert prepare_linears(_fresh(64, 64, torch.float32), "int4", cpu) == {"q4_0": 2}  # float32 activations too
    assert prepare_linears(_fresh(64, 64, torch.float32), "none", cpu, pack_weights=True) == {"packed": 2}


def test_bad_quantization_requests_fail_clearly() -> None:
    with pytest.raises(ValueError, match="allowed: none, int8, int4"):
        prepare_linears(nn.Sequential(nn.Linear(64, 64)), "fp4", torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8 runs on a CUDA GPU with FP8 tensor cores; on the CPU use int8"):
        prepare_linears(nn.Sequential(nn.Linear(64, 64)), "fp8", torch.device("cpu"))


def test_placed_weights_give_the_same_outputs_from_one_region_in_module_order() -> None:
    """place_weights copies every kernel linear's packed bytes into one huge-page region (Linux), in module
    order, a weight two modules share once; the outputs do not change by a bit."""
    import mmap

    from tokenmill.kernels.placement import ALIGN
    from tokenmill.models.linear import place_weights

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 96, bias=False), nn.Linear(96, 32))
    prepare_linears(model, "int8", torch.device("cpu"))
    model[2] = model[0]  # one weight, two modules
    inputs = [torch.randn(3, m.in_features) for m in model]
    before = [m(x) for m, x in zip(model, inputs, strict=True)]
    moved = place_weights(model)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        assert moved == 0
        pytest.skip("this platform has no huge-page advice for anonymous mappings: the weights stay where they are")
    first = -(-model[0].data.numel() // ALIGN) * ALIGN
    assert moved == first + -(-model[1].data.numel() // ALIGN) * ALIGN  # the shared weight once
    assert model[1].data.data_ptr() == model[0].data.data_ptr() + first  # in module order, back to back
    assert model[2].data.data_ptr() == model[0].data.data_ptr()
    after = [m(x) for m, x in zip(model, inputs, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))

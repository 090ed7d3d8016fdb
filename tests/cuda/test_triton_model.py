"""Whole models through the GPU's Triton kernels (kernels/cuda/): the layers' fused norms, RoPE and SwiGLU, the paged
cache's KV write and decode attention, and the int8 linears, against the same model on torch's ops.

On a GPU the engine binds the kernels itself (`--gpu-kernels`, the default); here the models run on the CPU with
the kernels interpreted (TRITON_INTERPRET=1), bound to a pure-torch model after loading, so the wiring is tested
on any machine that has Triton. scripts/test_cuda.sh runs the parity and engine suites with them compiled.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit defines the kernels
pytest.importorskip("triton", reason="Triton is not installed (CPU installs leave it out; `pip install triton`)")

from tests.parity.test_models import PROMPT, SPREAD
from tokenmill import LLM, SamplingParams
from tokenmill.attention import PagedKVCache
from tokenmill.kernels import formats
from tokenmill.kernels.cuda import CudaKernels
from tokenmill.models.layers import bind_kernels
from tokenmill.models.linear import CudaBlockLinear, KernelLinear, prepare_linears

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bind_triton(llm: LLM) -> CudaKernels:
    """Bind the Triton kernels to a model loaded without fused ops (what the loader does on a GPU)."""
    ops = CudaKernels(DEV)
    assert llm.loaded.ops is None or DEV == "cuda"
    bind_kernels(llm.loaded.model, ops)
    kv = llm.engine.runner.kv
    assert isinstance(kv, PagedKVCache) and kv.spare_slot is not None
    kv.ops = ops
    return ops


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_greedy_tokens_and_logprobs_match_torchs_ops(
    make_checkpoint: Callable[..., Path], arch: str, dtype: str, tol: float
) -> None:
    """Two prompts batched (prefill, then decodes of two context lengths crossing a block boundary)."""
    if dtype == "bfloat16" and DEV == "cpu":
        pytest.skip("Triton's interpreter truncates float32 -> bfloat16 casts (a GPU rounds, as torch): on a GPU only")
    folder = make_checkpoint(arch, **SPREAD)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [PROMPT, PROMPT[:11]]
    common = dict(dtype=dtype, device=DEV, cpu_kernels=False, gpu_kernels=False, enforce_eager=True, block_size=8)
    want = [o.outputs[0] for o in LLM(str(folder), **common).generate(prompts, params)]
    llm = LLM(str(folder), **common)
    _bind_triton(llm)
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la if t in lb) < tol


@pytest.mark.parametrize("quantization, fmt", [("int8", "q8_0"), ("int4", "q4_0")])
def test_quantized_linears_hold_the_cpu_paths_values_and_multiply_them(quantization: str, fmt: str) -> None:
    """prepare_linears with the GPU kernels: the same block values as the CPU's packed weight (and so a GGUF's),
    multiplied weight-only."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(80, 48, bias=True)  # 80 wide: padded to 96, a block and a half
    model = torch.nn.Sequential(linear).to(DEV)
    ops = CudaKernels(DEV)
    assert prepare_linears(model, quantization, torch.device(DEV), gpu_ops=ops) == {fmt: 1}
    gpu = model[0]
    assert isinstance(gpu, CudaBlockLinear)
    packed = KernelLinear.from_linear(linear, fmt, None)
    q, d = formats.unpack_blocks(packed.packed())
    assert torch.equal(gpu.q.cpu(), q) and torch.equal(gpu.d.cpu(), d.float())
    from_file = CudaBlockLinear.from_kernel_linear(packed, ops)  # a GGUF's blocks arrive as a KernelLinear
    assert torch.equal(from_file.q, q) and torch.equal(from_file.d, d.float())
    x = torch.randn(3, 80, device=DEV)
    want = F.linear(x, formats.unpack(packed.packed()).to(DEV), linear.bias)
    torch.testing.assert_close(gpu(x), want, atol=1e-4, rtol=1e-5)

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
from typing import Any

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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_float32_greedy_tokens_and_logprobs_match_torchs_ops(make_checkpoint: Callable[..., Path], arch: str) -> None:
    """Two prompts batched (prefill, then decodes of two context lengths crossing a block boundary), the prefills
    in the paged prefill kernel. llama and
    qwen2 rotate and write their KV in one launch, qwen3 with its q/k norms in the same launch; gemma3's MLP is a
    GeGLU (its attention keeps torch's ops around the KV write)."""
    folder = make_checkpoint(arch, **SPREAD)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [PROMPT, PROMPT[:11]]
    common = dict(dtype="float32", device=DEV, cpu_kernels=False, gpu_kernels=False, enforce_eager=True, block_size=8)
    reference, llm = LLM(str(folder), **common), LLM(str(folder), **common)
    for model in (reference.loaded.model, llm.loaded.model):
        _spread_norms(model)
    want = [o.outputs[0] for o in reference.generate(prompts, params)]
    ops = _bind_triton(llm)
    calls: dict[str, int] = {}
    for name in ("rope_kv_write_", "rope_", "kv_write", "gelu_mul", "silu_mul", "prefill_attention"):
        setattr(ops, name, _counted(getattr(ops, name), name, calls))
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert calls.get("prefill_attention")  # the prompts, the second one's prefix cached, in one launch a layer
    fused_kv = arch != "gemma3"
    assert bool(calls.get("rope_kv_write_")) == fused_kv and not calls.get("rope_")
    assert bool(calls.get("kv_write")) != fused_kv
    assert bool(calls.get("gelu_mul")) == (arch == "gemma3") != bool(calls.get("silu_mul"))
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la if t in lb) < 1e-4


def test_prefill_chunks_and_cached_prefixes_in_the_prefill_kernel(make_checkpoint: Callable[..., Path]) -> None:
    """Prompts in chunks of 8 tokens (a step's budget), then a prompt whose first blocks are cached: the prefill
    kernel reads the earlier positions from the pool. float32 tokens and logprobs as torch's ops give them."""
    folder = make_checkpoint("qwen2", **SPREAD)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    turns = [[PROMPT], [PROMPT + " And the second turn adds these words."]]
    common = dict(dtype="float32", device=DEV, cpu_kernels=False, gpu_kernels=False, enforce_eager=True, block_size=8,
                  max_num_batched_tokens=8, enable_chunked_prefill=True)  # fmt: skip
    reference = LLM(str(folder), **common)
    want = [o.outputs[0] for turn in turns for o in reference.generate(turn, params)]
    llm = LLM(str(folder), **common)
    ops = _bind_triton(llm)
    spans: list[tuple[int, int]] = []  # (new tokens, context length) of each prefill the kernel took
    prefill = ops.prefill_attention

    def prefill_attention(*args: Any, **kwargs: Any) -> None:
        spans.extend((n, ctx) for _, n, ctx in args[3].tolist())
        prefill(*args, **kwargs)

    ops.prefill_attention = prefill_attention  # type: ignore[method-assign]
    got = [o.outputs[0] for turn in turns for o in llm.generate(turn, params)]
    assert any(ctx > n for n, ctx in spans)  # a chunk after the first, or a cached prefix
    assert max(n for n, _ in spans) <= 8
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la if t in lb) < 1e-4


def test_gpt_oss_sinks_and_windows_in_the_triton_decode_attention(make_checkpoint: Callable[..., Path]) -> None:
    """gpt-oss's sinks and alternating 8-token windows through the paged decode kernel (prefills keep torch's
    attention with sinks): float32 greedy tokens and logprobs as torch's ops give them, past the window."""
    from tests.parity.test_gpt_oss import GPT_OSS

    folder = make_checkpoint("gpt_oss", **GPT_OSS)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [PROMPT[:40], PROMPT[:11]]
    common = dict(dtype="float32", device=DEV, cpu_kernels=False, gpu_kernels=False, enforce_eager=True, block_size=8)
    want = [o.outputs[0] for o in LLM(str(folder), **common).generate(prompts, params)]
    llm = LLM(str(folder), **common)
    ops = _bind_triton(llm)
    sinks_given: list[bool] = []
    attention = ops.decode_attention

    def decode_attention(*args: Any) -> torch.Tensor:
        sinks_given.append(args[6] is not None)  # (q, cache, tables, lens, block_size, window, sinks)
        return attention(*args)

    ops.decode_attention = decode_attention  # type: ignore[method-assign]
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert sinks_given and all(sinks_given)  # every decode step's layers through the kernel, with their sinks
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la if t in lb) < 1e-4


def _spread_norms(model: torch.nn.Module) -> None:
    """Every norm's weight drawn at random (a checkpoint's start as ones: q's and k's would be alike)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) / 4)


def _counted(fn: Callable[..., Any], name: str, calls: dict[str, int]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    return call


@pytest.mark.skipif(DEV == "cpu", reason="Triton's interpreter truncates float32 -> bfloat16 casts (a GPU rounds)")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_decodes_score_their_tokens_as_torchs_ops_do(make_checkpoint: Callable[..., Path], arch: str) -> None:
    """In bf16 two programs' greedy tokens part at near-ties (torch's own ops give other tokens batched than
    alone), so the bar is the scores: each token the Triton decodes chose gets the log-prob that torch's ops give
    it when they read the same sequence (a prefill through SDPA), within bf16's error."""
    folder = make_checkpoint(arch, **SPREAD)
    common = dict(dtype="bfloat16", device=DEV, cpu_kernels=False, gpu_kernels=False, enforce_eager=True, block_size=8)
    llm = LLM(str(folder), **common)
    _bind_triton(llm)
    ids = [llm.tokenizer.encode(p) for p in (PROMPT, PROMPT[:11])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": i} for i in ids], params)]
    torch_ops = LLM(str(folder), **common)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for prompt, out in zip(ids, outs, strict=True):
        seq = prompt + out.token_ids
        ref = torch_ops.generate([{"prompt_token_ids": seq}], scoring)[0].prompt_logprobs
        assert ref is not None and out.logprobs is not None
        errors = [abs(lp[t] - ref[len(prompt) + i][t]) for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs))]
        assert max(errors) < 0.1, errors


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
    q, d = q.to(DEV), d.float().to(DEV)
    assert torch.equal(gpu.q, q) and torch.equal(gpu.d, d)
    from_file = CudaBlockLinear.from_kernel_linear(packed, ops)  # a GGUF's blocks arrive as a KernelLinear
    assert torch.equal(from_file.q, q) and torch.equal(from_file.d, d)
    x = torch.randn(3, 80, device=DEV)
    want = F.linear(x, formats.unpack(packed.packed()).to(DEV), linear.bias)
    torch.testing.assert_close(gpu(x), want, atol=1e-4, rtol=1e-5)


def test_an_fp8_linear_quantizes_its_activations_in_the_triton_kernel() -> None:
    """`Fp8Linear` bound to the kernels: its activations in one launch (`fp8_rows`), its product as torch's path
    gives it (equal on a GPU; under the interpreter, whose float8 cast truncates, close)."""
    from tokenmill.models.gpu_linear import Fp8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True).to(DEV)
    ops = CudaKernels(DEV)
    calls: dict[str, int] = {}
    ops.fp8_rows = _counted(ops.fp8_rows, "fp8_rows", calls)  # type: ignore[method-assign]
    bound, plain = Fp8Linear.from_linear(linear, ops), Fp8Linear.from_linear(linear)
    x = torch.randn(3, 96, device=DEV, dtype=torch.bfloat16 if DEV == "cuda" else torch.float32)
    got, want = bound(x), plain(x)
    assert calls == {"fp8_rows": 1}
    if DEV == "cuda":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.1)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])),
     ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2))],
)  # fmt: skip
def test_a_moe_models_experts_in_the_grouped_gemms_match_torchs_ops(
    make_checkpoint: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    """The experts of every sparse layer in the GPU's two grouped GEMMs (kernels/cuda/moe.py), each expert's linears
    then views of the stacked weights, and the model recordable in CUDA graphs: float32 greedy tokens and
    logprobs as the per-expert path's."""
    from tokenmill.models.moe import SparseMoE

    folder = make_checkpoint(arch, **SPREAD, **overrides)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [PROMPT, PROMPT[:11]]
    common = dict(dtype="float32", device=DEV, cpu_kernels=False, gpu_kernels=False, enforce_eager=True, block_size=8)
    want = [o.outputs[0] for o in LLM(str(folder), **common).generate(prompts, params)]
    llm = LLM(str(folder), **common)
    model = llm.loaded.model
    assert not model.graph_capturable
    model.bind_gpu_ops(_bind_triton(llm))
    assert model.graph_capturable
    sparse = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert sparse and all(m._gpu is not None for m in sparse)
    stack = sparse[0]._gpu[1]  # type: ignore[index]
    assert sparse[0].experts[1].gate_up_proj.weight.data_ptr() == stack[1].data_ptr()  # a view, not a copy
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la if t in lb) < 1e-4

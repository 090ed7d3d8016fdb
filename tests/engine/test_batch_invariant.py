"""`--batch-invariant`: a request's tokens and logprobs are bit for bit the same alone and in any batch, through
chunked prefill, prefix-cache hits, preemption and speculation, in bfloat16, float32, int8 and int4. And the
linears' rows are each computed as alone, on every ISA variant this CPU runs."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parity.test_models import SPREAD
from tokenmill import LLM, SamplingParams
from tokenmill import kernels as kernel_variants
from tokenmill.kernels.isa import supported_levels
from tokenmill.models.linear import KernelLinear

pytestmark = pytest.mark.skipif(
    kernel_variants.active() is None, reason="no CPU kernels could be built here (no C++ compiler)"
)
RNG = random.Random(0)
SHARED = [RNG.randrange(3, 380) for _ in range(20)]  # two prompts start alike: the second hits the prefix cache
PROMPTS = [[RNG.randrange(3, 380) for _ in range(n)] for n in (5, 17, 40, 70, 9, 33)] + [SHARED + [7, 8], SHARED + [9]]
PROMPTS[5] = PROMPTS[5][:11] * 3  # repeats, for the ngram drafts to be accepted
MIXES = [PROMPTS, PROMPTS[::-1], PROMPTS[:3], PROMPTS[2:], [PROMPTS[1], PROMPTS[4]], PROMPTS[5:]]


@pytest.fixture(autouse=True)
def _amx_back() -> Iterator[None]:
    """The mode turns the compiled module's AMX tiles off for the whole process: back to the default after."""
    yield
    ops = kernel_variants.active()
    assert ops is not None
    ops.set_amx(-1)


def _params(prompt: list[int], drawn: bool) -> SamplingParams:
    if drawn and len(prompt) == 9:
        return SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=3)
    return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


def _run(llm: LLM, prompts: list[list[int]], drawn: bool) -> dict[tuple[int, ...], Any]:
    """One request is drawn (seeded: the same logits give the same draws) where `drawn`. Not with drafts: whether a
    step verifies drafts depends on the batch (speculative_disable_by_batch_size), and accepting one takes draws."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(p, drawn) for p in prompts])
    return {tuple(p): (o.outputs[0].token_ids, o.outputs[0].logprobs) for p, o in zip(prompts, outs)}


@pytest.mark.parametrize(
    "dtype, quantization, spec",
    [("float32", "none", None), ("bfloat16", "none", None), ("bfloat16", "int8", None), ("float32", "int4", None),
     ("bfloat16", "none", "ngram")],
)  # fmt: skip
def test_every_request_gives_the_same_bits_alone_and_in_any_mix(
    make_checkpoint: Callable[..., Path], dtype: str, quantization: str, spec: str | None
) -> None:
    """A 32-token budget chunks the prompts at other places in each mix, a 20-block pool preempts the big mixes,
    and the shared start hits the prefix cache in some runs and not in others."""
    folder = make_checkpoint("qwen2", **SPREAD, hidden_size=128, intermediate_size=256)
    llm = LLM(str(folder), dtype=dtype, device="cpu", quantization=quantization, batch_invariant=True,
              max_num_batched_tokens=32, block_size=8, num_kv_blocks=20, speculative_model=spec)  # fmt: skip
    alone: dict[tuple[int, ...], Any] = {}
    for p in PROMPTS:
        alone.update(_run(llm, [p], drawn=spec is None))
    for mix in MIXES:
        got = _run(llm, mix, drawn=spec is None)
        assert all(got[tuple(p)] == alone[tuple(p)] for p in mix), f"a request changed in a mix of {len(mix)}"
    assert llm.engine.stats.num_preemptions > 0
    if spec is not None:
        assert llm.engine.stats.spec_accepted_tokens > 0
        plain = LLM(str(folder), dtype=dtype, device="cpu", quantization=quantization, batch_invariant=True)
        assert _run(plain, PROMPTS, drawn=False) == alone  # verifying drafts computes each token as a decode step


@pytest.mark.parametrize("level", supported_levels())
@pytest.mark.parametrize("fmt", ["bf16", "f32", "q8_0", "q4_0"])
def test_row_invariant_linears_compute_each_row_as_alone(level: str, fmt: str) -> None:
    """Every row count from 1 to 96 and two prefill sizes: each row equals the row multiplied alone."""
    ops = kernel_variants.variant(level)
    old = ops.set_amx(0)  # as make_row_invariant sets it
    try:
        _check_rows(ops, fmt, level)
    finally:
        ops.set_amx(old)


def _check_rows(ops: kernel_variants.Kernels, fmt: str, level: str) -> None:
    torch.manual_seed(0)
    for n, k in ((160, 896), (96, 4864)):
        dense = torch.nn.Linear(k, n, bias=True)
        linear = KernelLinear.from_linear(dense, fmt, ops)
        linear.row_invariant = True
        x = torch.randn(200, k).to(torch.float32 if fmt == "f32" else torch.bfloat16)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
        for m in [*range(1, 97), 130, 200]:
            assert torch.equal(linear(x[:m]), alone[:m]), f"{level} {fmt} {n}x{k}: {m} rows"


def test_batch_invariant_refuses_the_paths_it_does_not_cover() -> None:
    for kwargs in (dict(device="cuda"), dict(cpu_kernels=False), dict(dtype="float16"), dict(kv_cache="contiguous")):
        with pytest.raises(ValueError, match="batch_invariant runs on the CPU kernels"):
            LLM(None, batch_invariant=True, **kwargs)

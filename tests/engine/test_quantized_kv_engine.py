"""The quantized KV caches (int8, fp8) in the engine: batching, chunked prefill, preemption and a prefix-cache hit
leave the greedy output as each request gets alone (every path reads the rows as stored), the decode stack reads and
writes them as the modules do, the pool holds 2 Dh / (Dh + 2) times the blocks in the same memory, and no KV block
leaks. Their quality: tests/parity/test_quantized_kv_quality.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import target
from tests.engine.test_batching import PARAMS, PROMPTS, assert_pool_full, assert_prefix_hit_keeps_tokens
from tokenmill import LLM, SamplingParams
from tokenmill.attention import PagedKVCache


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1)


@pytest.fixture(scope="module", params=["int8", "fp8"])
def kv(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _llm(folder: Path, kv: str = "int8", **kwargs: Any) -> LLM:
    kwargs.setdefault("dtype", "float32")
    return LLM(str(folder), device=target.DEVICE, kv_cache_dtype=kv, **kwargs)


def _run(llm: LLM, prompts: list[list[int]] = PROMPTS, params: list[SamplingParams] = PARAMS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_the_pool_holds_quantized_rows(folder: Path, kv: str) -> None:
    llm = _llm(folder, kv)
    pool = llm.engine.runner.kv
    want = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    assert isinstance(pool, PagedKVCache) and pool.cache.dtype == want and pool.scales is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_chunked_and_preempted_equals_each_request_alone(folder: Path, kv: str, dtype: str) -> None:
    solo = _llm(folder, kv, dtype=dtype, enable_prefix_caching=False)
    alone = [_run(solo, [p], [sp])[0] for p, sp in zip(PROMPTS[:12], PARAMS[:12])]
    for kwargs in (dict(enable_prefix_caching=False), dict(max_num_batched_tokens=8, enable_prefix_caching=False),
                   dict(num_kv_blocks=10, block_size=8)):  # fmt: skip
        llm = _llm(folder, kv, dtype=dtype, **kwargs)
        assert _run(llm, PROMPTS[:12], PARAMS[:12]) == alone, kwargs
        assert_pool_full(llm.engine)
    assert llm.engine.stats.num_preemptions > 0


def test_a_prefix_cache_hit_gives_the_same_tokens(folder: Path, kv: str) -> None:
    assert_prefix_hit_keeps_tokens(_llm(folder, kv))


def test_the_same_memory_holds_2dh_over_dh_plus_2_times_the_blocks(folder: Path) -> None:
    """Dh + 2 bytes a row against bf16's 2 Dh: 1.94x the blocks at Dh = 64, 1.97x at 128 (this model's Dh is 16)."""
    blocks, head_dim = {}, 0
    for kv_dtype in ("bfloat16", "int8", "fp8"):
        llm = LLM(str(folder), dtype="bfloat16", device=target.DEVICE, kv_cache_dtype=kv_dtype, kv_cache_memory_gb=0.01)
        pool = llm.engine.runner.kv
        assert isinstance(pool, PagedKVCache)
        blocks[kv_dtype], head_dim = pool.num_blocks, pool.cache.shape[-1]
        assert pool.nbytes <= 0.01 * 2**30
    assert blocks["int8"] == blocks["fp8"]
    assert blocks["int8"] / blocks["bfloat16"] == pytest.approx(2 * head_dim / (head_dim + 2), rel=1e-3)


def test_a_kv_dtype_the_backend_cannot_hold_is_one_clear_error(folder: Path) -> None:
    with pytest.raises(ValueError, match="needs the paged KV cache"):
        _llm(folder, kv_cache="contiguous")
    with pytest.raises(ValueError, match="allowed: auto, bfloat16, int8, fp8"):
        LLM(str(folder), kv_cache_dtype="fp4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_stack_reads_and_writes_quantized_rows_as_the_modules_do(folder: Path, kv: str, dtype: str) -> None:
    """Decode steps and decode runs over a quantized pool go through the decode stack (it quantizes each new row as
    kv_write does and widens rows as decode attention does): the module path's tokens, its logprobs within the
    dense stack's tolerance, and the same bytes in the pool."""
    target.cpu_only("the CPU kernels")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    results = []
    for use_stack in (True, False):
        llm = _llm(folder, kv, dtype=dtype, num_scheduler_steps=1, enable_prefix_caching=False)
        runner = llm.engine.runner
        if runner.decode_stack is None:
            from tokenmill import kernels

            assert kernels.active() is None, "the CPU kernels run here, so the stack must take the quantized pool"
            pytest.skip("no compiled CPU kernels here: the decode stack needs them")
        if not use_stack:
            runner.decode_stack = None
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    tol = 1e-5 if dtype == "float32" else 0.05
    for (tokens, logprobs), (want, want_logprobs) in zip(*results, strict=True):
        assert tokens == want
        assert max(abs(a[t] - b[t]) for a, b in zip(logprobs, want_logprobs) for t in a) < tol
    runs = _llm(folder, kv, dtype=dtype, num_scheduler_steps=4)
    assert runs.engine.runner.runs_decode_steps
    assert [o.outputs[0].token_ids for o in runs.generate(prompts, params)] == [r[0] for r in results[0]]
    assert_pool_full(runs.engine)

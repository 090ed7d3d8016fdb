"""Continuous batching, chunked prefill, preemption, prefix caching and abort never change greedy output,
and never leak a KV block."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core import EngineCore
from tokenmill.types import EngineRequest


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", initializer_range=0.1)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


PROMPTS = _prompts(32)
PARAMS = [SamplingParams(temperature=0, max_tokens=4 + i % 13, ignore_eos=True) for i in range(32)]


def _llm(folder: Path, **kwargs: Any) -> LLM:
    return LLM(str(folder), dtype="float32", device=target.DEVICE, **kwargs)


def _run(llm: LLM, prompts: list[list[int]] = PROMPTS, params: list[SamplingParams] = PARAMS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def assert_pool_full(engine: EngineCore) -> None:
    assert engine.kv is not None and not engine.has_unfinished()
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def assert_prefix_hit_keeps_tokens(llm: LLM) -> None:
    """A prompt sent twice: the second run reads the first's cached blocks and gives the same greedy tokens, and no
    block leaks."""
    shared = PROMPTS[0] + PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": shared}], params)[0]
    second = llm.generate([{"prompt_token_ids": shared}], params)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.metrics is not None and second.metrics.num_cached_tokens > 0
    assert_pool_full(llm.engine)


@pytest.fixture(scope="module")
def alone(folder: Path) -> list[list[int]]:
    """Each request run by itself: the reference every batched configuration must reproduce."""
    llm = _llm(folder, enable_prefix_caching=False)
    return [_run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]


def test_32_concurrent_equal_each_alone(folder: Path, alone: list[list[int]]) -> None:
    llm = _llm(folder, enable_prefix_caching=False)
    assert _run(llm) == alone
    assert llm.engine.stats.max_batch_size == 32
    assert_pool_full(llm.engine)


def test_chunked_prefill_with_tiny_budget(folder: Path, alone: list[list[int]]) -> None:
    llm = _llm(folder, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _run(llm) == alone
    steps = llm.engine.stats.recent_steps
    assert max(s.num_tokens for s in steps) <= 8
    assert any(s.num_decode_tokens and s.num_tokens > s.num_decode_tokens for s in steps)  # decodes mixed with prefill
    assert_pool_full(llm.engine)


def test_preemption_under_a_tiny_kv_pool(folder: Path, alone: list[list[int]]) -> None:
    llm = _llm(folder, num_kv_blocks=12, block_size=8)  # 96 token slots for 32 requests of up to 76 tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert llm.engine.stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs if o.metrics) == llm.engine.stats.num_preemptions
    assert_pool_full(llm.engine)


def test_static_batching_and_other_kv_modes(folder: Path, alone: list[list[int]]) -> None:
    llm = _llm(folder, batching="static", max_num_seqs=8)
    assert _run(llm) == alone
    assert llm.engine.stats.max_batch_size == 8
    assert _run(_llm(folder, kv_cache="contiguous")) == alone
    assert _run(_llm(folder, kv_cache="none")) == alone


def test_prefix_cache_hit_same_output_fewer_computed_tokens(folder: Path) -> None:
    prefix = _prompts(1, seed=5)[0] * 2  # > 64 tokens: several full blocks
    prompts = [[*prefix, 7, 8, 9], [*prefix, 10, 11]]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2
    cold = _llm(folder, enable_prefix_caching=False)
    expected = [_run(cold, [p], params[:1])[0] for p in prompts]
    llm = _llm(folder, block_size=16)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params[0])[0]
    second = llm.generate([{"prompt_token_ids": prompts[1]}], params[1])[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == expected
    assert first.metrics is not None and second.metrics is not None
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == len(prefix) // 16 * 16
    kv = llm.engine.kv
    assert kv is not None and kv.prefix_cache_hits == second.metrics.num_cached_tokens
    assert_pool_full(llm.engine)


def test_n_samples_share_prompt_blocks(folder: Path) -> None:
    prompt = _prompts(1, seed=9)[0] * 3  # well over 4 blocks of 16
    llm = _llm(folder, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, max_tokens=6, n=4, seed=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert len(out.outputs) == 4
    computed = sum(s.num_tokens - s.num_decode_tokens for s in llm.engine.stats.recent_steps)
    tail = len(prompt) - (len(prompt) - 1) // 16 * 16  # what each later sample recomputes itself
    assert computed == len(prompt) + 3 * tail + 4 * 0  # not 4 full prefills
    assert_pool_full(llm.engine)


def test_abort_mid_generation_returns_every_block(folder: Path) -> None:
    llm = _llm(folder)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        engine.add_request(EngineRequest(rid, prompt, params, engine.validate(prompt, params)))
    for _ in range(3):
        engine.step()
    assert engine.kv is not None and engine.kv.num_free_blocks < engine.kv.num_blocks
    assert engine.abort("a") and not engine.abort("missing")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["b"]
    assert_pool_full(engine)


def test_priority_policy_runs_urgent_requests_first(folder: Path) -> None:
    llm = _llm(folder, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, priority=[3, 1, 2, 0])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_token_time)  # type: ignore[union-attr]
    assert order == [3, 1, 2, 0]


def test_a_sample_that_must_wait_for_a_whole_prompt_step_gives_back_its_fork(folder: Path) -> None:
    """Without chunked prefill, an n = 2 request's second sample forks the first's prompt blocks, then finds the
    step's budget taken by a more urgent prompt and waits: the fork goes back with it, so its next try forks
    again (it once raised "already has blocks" and stopped the engine), and both samples finish alike."""
    llm = _llm(folder, enable_chunked_prefill=False, scheduling_policy="priority", max_model_len=64,
               max_num_batched_tokens=64)  # fmt: skip
    engine = llm.engine
    shared = [(7 * i) % 300 + 3 for i in range(47)]
    pair = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    engine.add_request(EngineRequest("pair", shared, pair, engine.validate(shared, pair), priority=1))
    engine.step()  # the first sample's prompt; the second waits for it
    urgent = [(11 * i) % 300 + 3 for i in range(52)]
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request(EngineRequest("urgent", urgent, short, engine.validate(urgent, short), priority=0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    done = {o.request_id: o for o in outs if o.finished}
    assert sorted(done) == ["pair", "urgent"]
    first, second = done["pair"].outputs
    assert first.token_ids == second.token_ids and len(first.token_ids) == 10
    assert_pool_full(engine)


def test_requests_that_can_never_fit_are_rejected(folder: Path) -> None:
    llm = _llm(folder, num_kv_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="needs 5 KV blocks .* the whole pool has 4"):
        llm.generate([{"prompt_token_ids": [5] * 30}], SamplingParams(max_tokens=10))
    assert _run(llm, [[5] * 20], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert_pool_full(llm.engine)


def test_a_failure_inside_the_engine_ends_only_its_request(folder: Path, alone: list[list[int]]) -> None:
    """Two requests (one of two samples) fail in the same step: each ends with its error, the others are served."""
    llm = _llm(folder)
    llm.engine.runner.hooks.fault_token = 5  # the runner raises on a sequence whose first token is 5 (its test hook)
    bad = SamplingParams(temperature=0, max_tokens=4, n=2, ignore_eos=True)
    prompts = [*PROMPTS[:3], [5, 6, 7], [5, 8, 9, 10]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [*PARAMS[:3], bad, PARAMS[0]])
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone[:3]
    for failed, samples in zip(outs[3:], (2, 1), strict=True):
        assert failed.finished and failed.error is not None and "injected fault" in failed.error
        assert [c.finish_reason for c in failed.outputs] == ["error"] * samples
    assert llm.engine.stats.num_failed == 2
    assert_pool_full(llm.engine)
    llm.engine.runner.hooks.fault_token = None
    assert _run(llm, PROMPTS[:2], PARAMS[:2]) == alone[:2]  # and the engine serves on


def test_a_failed_prompt_leaves_no_unwritten_block_to_the_prefix_cache(folder: Path) -> None:
    """A prompt's full blocks are registered for the prefix cache when its step is scheduled. When that step fails
    for it, they were never written: no later request may take them (it would attend to garbage), nor one
    admitted in the same step right after it, which is recomputed instead. Both get what a cache-less engine
    gives."""
    fails = [5] + [(7 * i) % 300 + 3 for i in range(40)]  # the first request: it trips the runner's test hook
    same_step = fails[:16] + [(11 * i) % 300 + 3 for i in range(20)]  # shares its first block of 16
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _llm(folder, enable_prefix_caching=False)
    want = _run(plain, [same_step, fails], [params] * 2)
    llm = _llm(folder, enable_prefix_caching=True)
    llm.engine.runner.hooks.fault_request = "0"  # the first request id LLM.generate gives
    outs = llm.generate([{"prompt_token_ids": p} for p in (fails, same_step)], params)
    assert outs[0].error is not None and outs[1].error is None
    assert outs[1].outputs[0].token_ids == want[0]
    assert outs[1].metrics is not None and outs[1].metrics.num_preemptions == 1  # recomputed, not served garbage
    assert_pool_full(llm.engine)
    llm.engine.runner.hooks.fault_request = None
    again = llm.generate([{"prompt_token_ids": fails}], params)[0]  # the same prompt, now without the fault
    assert again.outputs[0].token_ids == want[1]
    assert again.metrics is not None and again.metrics.num_cached_tokens <= 16  # at most the block B rewrote
    assert_pool_full(llm.engine)


def test_touch_kv_cache_makes_the_pool_resident_at_start(folder: Path) -> None:
    """The pool is torch.empty (pages arrive as blocks are first used) unless --touch-kv-cache writes it all."""
    import psutil

    from tokenmill.attention import PagedKVCache

    target.cpu_only("the residency of a KV pool in host memory")

    def rss_growth(**kwargs: Any) -> tuple[int, int]:
        before = psutil.Process().memory_info().rss
        llm = _llm(folder, num_kv_blocks=24_000, **kwargs)
        backend = llm.engine.runner.kv
        assert isinstance(backend, PagedKVCache)
        return psutil.Process().memory_info().rss - before, backend.cache.numel() * backend.cache.element_size()

    lazy, pool = rss_growth()
    touched, _ = rss_growth(touch_kv_cache=True)
    assert pool > 150 * 2**20 and lazy < pool / 2 and touched > 0.9 * pool, (lazy, touched, pool)
    with pytest.raises(ValueError, match="touch_kv_cache needs kv_cache='paged'"):
        _llm(folder, kv_cache="contiguous", touch_kv_cache=True)
    for sizing in ({"num_kv_blocks": 64}, {"kv_cache_memory_gb": 0.5}):  # (ignored silently before)
        with pytest.raises(ValueError, match=f"{next(iter(sizing))} needs kv_cache='paged'; kv_cache='contiguous'"):
            _llm(folder, kv_cache="contiguous", **sizing)


def test_a_stop_found_by_the_server_ends_one_sample_and_frees_its_blocks(folder: Path) -> None:
    """`EngineCore.stop_sequence` (the server found a stop string: engine/request_text.py): that sample ends with
    its first k tokens, finish_reason "stop" and the stop string, and its blocks go back; the others run on, and
    the request's tokens are those an unstopped run gives, cut there. A stop for a finished sample is nothing."""
    llm = _llm(folder, enable_prefix_caching=False)
    engine = llm.engine
    prompt = PROMPTS[2] * 4  # (several blocks: a freed sample's blocks show)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, n=2, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs
    engine.add_request(EngineRequest("r", prompt, params, engine.validate(prompt, params)))
    while not engine.requests["r"][1].output_token_ids[3:]:
        engine.step()
    used = engine.kv.num_blocks - engine.kv.num_free_blocks
    outs = engine.stop_sequence("r", 1, 2, "xyz")
    assert [(o.outputs[1].token_ids, o.outputs[1].finish_reason, o.outputs[1].stop_reason) for o in outs] == [
        (free[1].token_ids[:2], "stop", "xyz")
    ]
    assert engine.kv.num_blocks - engine.kv.num_free_blocks < used
    assert engine.stop_sequence("r", 1, 1, "again") == [] and engine.stop_sequence("gone", 0, 1, "x") == []
    while engine.has_unfinished():
        outs += engine.step()
    final = outs[-1]
    assert final.finished and [c.token_ids for c in final.outputs] == [free[0].token_ids, free[1].token_ids[:2]]
    assert engine.stats.generation_tokens == len(free[0].token_ids) + 2 + sum(len(c.token_ids) for c in free)
    assert_pool_full(engine)

"""The background-loop engine: concurrent streams, abort (explicit and by closing the stream), errors."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.request_stream import EngineDeadError, RequestFailedError
from tokenmill.outputs import RequestOutput
from tokenmill.types import ModelInput, RunnerOutput

PROMPTS = ["Hello world!", "To be, or not to be", "The quick brown fox", "café", "Shall I compare"] * 2
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen3", initializer_range=0.1)


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    """Only ever driven by the engine thread of the test using it (the core is single-threaded)."""
    return LLM(str(folder), dtype="float32")


@pytest.fixture()
def engine(llm: LLM) -> Iterator[AsyncEngine]:
    eng = AsyncEngine(llm.engine, llm.loaded)
    eng.start()
    yield eng
    eng.shutdown()


async def _collect(engine: AsyncEngine, prompt: str, params: SamplingParams) -> RequestOutput:
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    assert final is not None
    return final


def _pool_full(engine: AsyncEngine) -> bool:
    kv = engine.core.kv
    assert kv is not None
    kv.check_integrity()
    return not engine.core.has_unfinished() and kv.num_free_blocks == kv.num_blocks


async def _wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_concurrent_streams_equal_offline_generate(folder: Path, engine: AsyncEngine) -> None:
    offline = LLM(str(folder), dtype="float32")
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)]

    async def main() -> list[RequestOutput]:
        return await asyncio.gather(*(_collect(engine, p, GREEDY) for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert _pool_full(engine)


@contextlib.contextmanager
def _held_after(engine: AsyncEngine, steps: int) -> Iterator[threading.Event]:
    """The engine's loop stops before its step number `steps + 1` until the event is set (or 60 s pass): what
    the test does meanwhile lands before the request can finish, on any CPU."""
    runner = engine.core.runner
    original = runner.execute
    release, count = threading.Event(), [0]

    def held(batch: ModelInput) -> RunnerOutput:
        count[0] += 1
        if count[0] > steps:
            release.wait(60)
        return original(batch)

    runner.execute = held  # type: ignore[method-assign]
    try:
        yield release
    finally:
        release.set()
        runner.execute = original  # type: ignore[method-assign]


def test_closing_a_stream_aborts_within_a_step(engine: AsyncEngine) -> None:
    async def main() -> None:
        # 3 steps give at least 3 outputs; the 4th waits until the stream is closed (400 tokens raced the close)
        with _held_after(engine, 3) as release:
            stream = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            seen = 0
            async for _ in stream:  # type: ignore[attr-defined]
                seen += 1
                if seen == 3:
                    break
            await stream.aclose()  # type: ignore[attr-defined]
            release.set()
            await _wait_until(lambda: _pool_full(engine))
        assert engine.core.stats.num_aborted >= 1

    asyncio.run(main())


def test_explicit_abort_ends_stream_with_abort(engine: AsyncEngine) -> None:
    async def main() -> RequestOutput:
        final, aborted = None, False
        # 2 steps give at least 2 tokens; the 3rd waits for the abort (400 tokens raced it)
        with _held_after(engine, 2) as release:
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            async for out in engine.generate("Hello", params, request_id="r1"):
                final = out
                if len(out.outputs[0].token_ids) >= 2 and not aborted:  # a decode run brings several tokens at once
                    engine.abort("r1")
                    aborted = True
                    release.set()
        assert final is not None
        return final

    final = asyncio.run(main())
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 2 <= len(final.outputs[0].token_ids) < 400
    assert _pool_full(engine)


def test_bad_request_fails_at_once_and_harms_no_one(engine: AsyncEngine) -> None:
    async def main() -> None:
        good = asyncio.create_task(_collect(engine, "Hello", GREEDY))
        with pytest.raises(ValueError, match="maximum context length"):
            await _collect(engine, "Hello", SamplingParams(max_tokens=10**6))
        assert (await good).outputs[0].finish_reason == "length"

    asyncio.run(main())
    assert _pool_full(engine)


def test_dead_engine_is_unhealthy_and_fails_open_streams(llm: LLM) -> None:
    """A failure outside any one request's work (here the scheduler) kills the loop: every stream hears it."""
    engine = AsyncEngine(llm.engine, llm.loaded)
    died: list[BaseException] = []
    engine.on_death = died.append
    engine.start()
    scheduler = llm.engine.scheduler
    original = scheduler.schedule

    def broken() -> None:
        raise RuntimeError("simulated scheduler bug")

    scheduler.schedule = broken  # type: ignore[method-assign,assignment]
    try:

        async def main() -> None:
            with pytest.raises(EngineDeadError, match="simulated scheduler bug"):
                await _collect(engine, "Hello", GREEDY)

        asyncio.run(main())
        assert not engine.is_healthy and len(died) == 1
    finally:
        scheduler.schedule = original  # type: ignore[method-assign]
        for rid in list(llm.engine.requests):
            llm.engine.abort(rid)


def test_a_step_failure_fails_its_request_and_the_engine_serves_on(engine: AsyncEngine) -> None:
    """A failure while running the model is pinned on the request that caused it (each is retried alone)."""
    runner = engine.core.runner
    original = runner.execute

    def broken_for_long_prompts(batch: ModelInput) -> RunnerOutput:
        if any(len(s.token_ids) > 3 for s in batch.sequences):
            raise RuntimeError("simulated kernel failure")
        return original(batch)

    runner.execute = broken_for_long_prompts  # type: ignore[method-assign]
    try:

        async def main() -> tuple[RequestOutput, BaseException]:
            good = asyncio.create_task(_collect(engine, [5, 6], GREEDY))
            bad = asyncio.create_task(_collect(engine, [5, 6, 7, 8, 9], GREEDY))
            failure = await asyncio.gather(bad, return_exceptions=True)
            return await good, failure[0]

        good, failure = asyncio.run(main())
    finally:
        runner.execute = original  # type: ignore[method-assign]
    assert isinstance(failure, RequestFailedError) and "simulated kernel failure" in str(failure)
    assert good.finished and len(good.outputs[0].token_ids) == GREEDY.max_tokens
    assert engine.is_healthy and _pool_full(engine)


def test_the_start_up_description_states_weights_kv_pool_and_resident_memory(llm: LLM, engine: AsyncEngine) -> None:
    """`tokenmill serve` logs this line at start: where the memory went, in MiB."""
    import re

    from tokenmill.attention import PagedKVCache

    found = re.search(
        r"memory: weights (\d+) MiB, KV pool (\d+) MiB reserved, process RSS (\d+) MiB", engine.description
    )
    assert found is not None, engine.description
    weights, pool, rss = (int(g) for g in found.groups())
    model = llm.loaded.model
    tensors = {t.data_ptr(): t.nbytes for t in [*model.parameters(), *model.buffers()] if t.numel()}
    assert weights == round(sum(tensors.values()) / 2**20)  # every weight the model holds, once
    kv = llm.engine.runner.kv
    assert isinstance(kv, PagedKVCache) and pool == round(kv.cache.nbytes / 2**20)
    assert rss >= weights + 1


def test_going_idle_lets_the_step_buffers_go(llm: LLM, engine: AsyncEngine) -> None:
    """The MLPs' shared scratch grows with a step's rows and stays while requests run; once none is left the
    engine lets it go (with the allocator's freed pages), and the next request allocates it again: same tokens."""
    from tokenmill.models.layers import GatedMLP

    scratches = {id(m.scratch): m.scratch for m in llm.loaded.model.modules() if isinstance(m, GatedMLP) and m.scratch}
    if not scratches:
        pytest.skip("no compiled CPU kernels here: the MLPs run in torch and share no scratch")
    scratch = next(iter(scratches.values()))
    scratch.get("gate_up", 4, 4, llm.loaded.dtype)  # held until the engine next goes idle

    async def run() -> tuple[list[int], list[int]]:
        first = await _collect(engine, PROMPTS[1], GREEDY)
        await _wait_until(lambda: _pool_full(engine) and not scratch._buffers)
        second = await _collect(engine, PROMPTS[1], GREEDY)
        await _wait_until(lambda: _pool_full(engine) and not scratch._buffers)
        return list(first.outputs[0].token_ids), list(second.outputs[0].token_ids)

    first, second = asyncio.run(run())
    assert first == second

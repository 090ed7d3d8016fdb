"""Embeddings yield to decoding streams (pooling_share.py): the budget from the step times reported to the scheduler,
and the scheduler holding pooling prompts to it only while generation sequences decode. Step times here are given,
never measured: nothing depends on the CPU's speed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_scheduler import make_request, plan
from tokenmill.kv_cache import KVCacheManager
from tokenmill.pooling_params import PoolingParams
from tokenmill.pooling_share import PoolingShare
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.types import Request, SchedulerOutput


def test_the_budget_is_the_share_of_a_decode_step_that_prompt_tokens_take() -> None:
    share = PoolingShare(0.5, min_tokens=4, first_tokens=64)
    assert share.budget() == 64  # nothing measured yet
    share.observe(0.5, 1, 0, 100)  # prompt tokens alone: 5 ms each
    assert share.budget() == 64  # no decode step yet
    share.observe(0.8, 4, 16, 0)  # a decode run of 4 steps: 0.2 s a step
    assert share.decode_s == pytest.approx(0.2) and share.token_s == pytest.approx(0.005)
    assert share.budget() == 20  # 0.5 x 0.2 s / 5 ms
    share.observe(0.2 + 0.1, 1, 16, 10)  # decodes with 10 prompt tokens that added 0.1 s: 10 ms each
    assert share.token_s == pytest.approx(0.75 * 0.005 + 0.25 * 0.01)
    assert share.budget() == int(0.5 * 0.2 / share.token_s)
    share.observe(30.0, 1, 16, 10)  # a very slow step: the budget bottoms out, never at zero
    assert share.budget() == 4
    share.observe(0.0, 1, 16, 0)  # nothing to learn from an empty or unmeasured step
    assert share.decode_s == pytest.approx(0.2)


def _pooling(rid: str, prompt_len: int, arrival: int) -> Request:
    return replace(make_request(rid, prompt_len, arrival, max_tokens=1), pooling=PoolingParams())


def _run(sched: Scheduler, out: SchedulerOutput) -> None:
    """A fake runner: scheduled tokens computed; a finished prompt samples a token, or (pooling) ends there."""
    by_id = {r.request_id: r for r in sched.running}
    for s in out.scheduled:
        req = by_id[s.request_id]
        req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
        if req.num_computed_tokens == req.num_tokens:
            if req.pooling is not None:
                sched.remove(req)
            else:
                req.output_token_ids.append(1)


def _scheduler(share: float) -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, pooling_share=share), KVCacheManager(64, 4))
    if sched.pooling is not None:
        sched.observe_step(0.1, 1, 1, 0)  # a decode step: 0.1 s
        sched.observe_step(0.1 + 0.25, 1, 1, 100)  # 100 prompt tokens added 0.25 s: budget 0.5 x 0.1 / 0.0025
    return sched


def test_pooling_prompts_take_their_budget_while_a_stream_decodes_and_hold_back_no_one() -> None:
    sched = _scheduler(0.5)
    assert sched.pooling is not None and sched.pooling.budget() == 20
    sched.add(make_request("g", 4, 0))
    _run(sched, sched.schedule())  # g's prompt: it decodes from now on
    sched.add(_pooling("e", 40, 1))
    sched.add(make_request("h", 5, 2))  # behind the embedding, admitted beside it all the same
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append(plan(out))
        _run(sched, out)
    assert steps == [[("g", 1), ("e", 20), ("h", 5)], [("g", 1), ("e", 20), ("h", 1)], [("g", 1), ("h", 1)]]
    assert all(r.request_id != "e" for r in sched.running)  # its prompt done: pooled and gone


@pytest.mark.parametrize("share", [0.5, 0.0])
def test_without_decoding_streams_or_a_share_pooling_prompts_take_the_whole_budget(share: float) -> None:
    sched = _scheduler(share)
    sched.add(_pooling("e", 40, 0))
    sched.add(make_request("g", 20, 1))  # a prompt, not a decode: nothing to yield to yet
    assert plan(sched.schedule()) == [("e", 40), ("g", 20)]
    if share == 0:  # and with streams decoding, no share means no limit
        sched = _scheduler(0.0)
        sched.add(make_request("g", 4, 0))
        _run(sched, sched.schedule())
        sched.add(_pooling("e", 40, 1))
        assert plan(sched.schedule()) == [("g", 1), ("e", 40)]

"""The scheduler with a fake runner (pure Python): budgets, chunking, preemption order, priority order."""

from __future__ import annotations

from tokenmill.kv_cache import KVCacheManager
from tokenmill.outputs import RequestMetrics
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.types import Request, SchedulerOutput


def make_request(rid: str, prompt_len: int, arrival: int = 0, priority: int = 0, max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid,
        parent_id=rid,
        index=0,
        prompt_token_ids=[(i * 7 + sum(map(ord, rid))) % 50 for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=frozenset(),
        metrics=RequestMetrics(arrival_time=0.0),
        arrival_order=arrival,
        priority=priority,
    )


def fake_run(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the runner + core do: preempted requests lose their computed tokens; scheduled ones advance; a
    request that reached its end samples a token."""
    by_id = {r.request_id: r for r in sched.running + sched.waiting}
    for rid in out.preempted:
        by_id[rid].num_computed_tokens = 0
    for s in out.scheduled:
        req = by_id[s.request_id]
        req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(1)
            if len(req.output_token_ids) >= req.max_tokens:
                req.finish_reason = "length"
                sched.remove(req)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_and_chunked_prefill() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), KVCacheManager(64, 4))
    sched.add(make_request("a", 25))
    sched.add(make_request("b", 3))
    steps = []
    for _ in range(4):
        out = sched.schedule()
        steps.append(plan(out))
        fake_run(sched, out)
    # a's prompt is cut in chunks of the budget; b joins once a leaves room, and decodes then mix in
    assert steps[0] == [("a", 10)]
    assert steps[1] == [("a", 10)]
    assert steps[2] == [("a", 5), ("b", 3)]
    assert steps[3] == [("a", 1), ("b", 1)]


def test_without_chunking_a_prompt_waits_for_a_step_it_fits_in() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, enable_chunked_prefill=False), KVCacheManager(64, 4))
    sched.add(make_request("a", 6))
    sched.add(make_request("b", 6))
    out = sched.schedule()
    assert plan(out) == [("a", 6)]  # b would need 6 more of the 4 left: it waits whole
    fake_run(sched, out)
    assert plan(sched.schedule()) == [("a", 1), ("b", 6)]


def test_at_most_max_num_seqs_run_in_arrival_order() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), KVCacheManager(64, 4))
    for i in range(4):
        sched.add(make_request(f"r{i}", 2, arrival=i))
    assert [rid for rid, _ in plan(sched.schedule())] == ["r0", "r1"]


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    kv = KVCacheManager(4, 4)  # 16 token slots
    sched = Scheduler(SchedulerConfig(), kv)
    a, b = make_request("a", 7, arrival=0, max_tokens=20), make_request("b", 7, arrival=1, max_tokens=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 7), ("b", 7)] and kv.num_free_blocks == 0
    fake_run(sched, out)
    out = sched.schedule()  # position 7 still fits in each one's second block
    assert plan(out) == [("a", 1), ("b", 1)] and not out.preempted
    fake_run(sched, out)  # now both hold 2 full blocks: position 8 needs a fifth block
    out = sched.schedule()
    assert out.preempted == ["b"] and plan(out) == [("a", 1)]
    assert b not in sched.running and sched.waiting[0] is b and sched.num_preemptions == 1
    assert not kv.block_table("b")  # its blocks are gone; the core resets its computed tokens
    fake_run(sched, out)
    assert b.num_computed_tokens == 0 and b.metrics.num_preemptions == 0  # the core (here fake_run) owns both
    kv.check_integrity()


def test_priority_policy_orders_admission_and_preemption() -> None:
    kv = KVCacheManager(4, 4)
    sched = Scheduler(SchedulerConfig(policy="priority", max_num_seqs=2), kv)
    low, high, mid = (make_request(n, 7, arrival=i, priority=p, max_tokens=20)
                      for i, (n, p) in enumerate([("low", 5), ("high", 0), ("mid", 1)]))  # fmt: skip
    for r in (low, high, mid):
        sched.add(r)
    out = sched.schedule()
    assert plan(out) == [("high", 7), ("mid", 7)]  # arrival order would have run "low" first
    fake_run(sched, out)
    fake_run(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == ["mid"]  # the lowest priority running request goes, not the newest arrival


def test_static_batching_admits_only_when_drained() -> None:
    sched = Scheduler(SchedulerConfig(batching="static"), KVCacheManager(64, 4))
    first = make_request("a", 3, max_tokens=2)
    sched.add(first)
    out = sched.schedule()
    fake_run(sched, out)
    sched.add(make_request("b", 3))
    out = sched.schedule()
    assert plan(out) == [("a", 1)]  # b waits although there is room
    fake_run(sched, out)  # a finishes
    assert plan(sched.schedule()) == [("b", 3)]


def test_prefix_hit_starts_at_the_cached_tokens() -> None:
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    a = make_request("a", 10, max_tokens=1)
    sched.add(a)
    fake_run(sched, sched.schedule())  # a finishes; its 2 full blocks stay cached
    twin = make_request("a", 10)  # same prompt
    twin.request_id = "twin"
    sched.add(twin)
    out = sched.schedule()
    assert plan(out) == [("twin", 2)] and out.scheduled[0].num_computed_tokens == 8
    assert out.num_cached_tokens == {"twin": 8}
    kv.check_integrity()


def test_drafts_that_do_not_fit_are_dropped_rather_than_preempting() -> None:
    """Drafts are optional: when the pool has room for a running request's next token but not for its drafts'
    lookahead slots, the step verifies no drafts, and nobody (least of all the request itself, the newest one,
    which preemption would take first) is preempted for them."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(4, 4))
    for rid in ("a", "b"):
        sched.add(make_request(rid, 6, max_tokens=16))
    for _ in range(2):  # both prompts in, then a decode: each holds 2 blocks of 4, the pool's 4 are all taken
        fake_run(sched, sched.schedule())
    b = next(r for r in sched.running if r.request_id == "b")
    b.spec_token_ids = [3, 4, 5]  # b at 7 tokens: its 8th fits its last block, drafts would need a third
    out = sched.schedule()
    assert out.preempted == [] and sched.num_preemptions == 0
    assert {s.request_id: (s.num_new_tokens, s.spec_token_ids) for s in out.scheduled} == {"a": (1, ()), "b": (1, ())}

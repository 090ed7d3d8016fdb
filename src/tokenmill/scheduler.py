"""The scheduler: who runs this step and how many tokens each computes. Never touches tensors, never writes
a `Request`: it owns its queues and its calls into the KV manager, and says what it decided in a
`SchedulerOutput` that the engine core applies.

Token-centric (as vLLM v1): a request only has `num_computed_tokens` and `num_tokens`. A prefill, a
prefill chunk, a decode and a prefix-cache hit are all "compute the next k tokens". Each step:

1. Running requests first, in policy order, each taking up to its remaining tokens from the step's
   `max_num_batched_tokens` budget (decodes take 1; a long prompt takes what is left: chunked prefill).
   When the KV pool has no room, the lowest-priority / newest running request is preempted: its blocks are
   freed and it goes back to the front of the waiting queue to be recomputed later. Never dropped.
2. Then waiting requests, in policy order, while the budget, `max_num_seqs` and the pool allow. A waiting
   request has nothing computed; it first looks up its prompt in the prefix cache, and `n > 1` siblings
   share the first sample's prompt blocks once they are computed.

`batching="static"` admits nothing while anything runs: the whole batch drains first (the baseline).

While generation sequences decode, pooling prompts (embeddings, scores) take at most `PoolingShare.budget()` tokens
a step between them, running chunks and admissions alike (pooling_share.py: `pooling_share` of a decode step's
time, from the step times the core reports to `observe_step`), and a pooling request past it waits without
holding back the requests behind it.

3. Decode runs (`num_scheduler_steps`, as vLLM's multi-step scheduling): when every scheduled sequence decodes
   with nothing but a draw or the argmax reading its logits and may take several steps (`Request.multi_step_limit`,
   which the core sets), at most `MAX_SEQS_FOR_RUNS` run, none waits and each gets the slots of its run without
   preempting anyone, the step decodes that many tokens for each in one call. A newcomer waits for the run's end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.config import STEP_TOKENS
from tokenmill.kv_cache import KVManager, hash_block_tokens
from tokenmill.pooling_share import PoolingShare
from tokenmill.types import Request, ScheduledRequest, SchedulerOutput

# decode runs only while this few sequences run: the Python a run saves, ~0.25 ms a token (Zen 4, int4), matters
# against a one-row step (~10 ms) and not against a 16-row one, where a newcomer would wait several long steps instead
MAX_SEQS_FOR_RUNS = 4


def prefix_salt(req: Request) -> int | None:
    """The salt `req`'s prefix-cache hashes chain on: its adapter's digest, and a chain of its own where its positions
    below `rope_long_below` rotate by LongRoPE's long factors (their keys are not a shorter prompt's)."""
    if not req.rope_long_below:
        return req.cache_salt
    return hash_block_tokens(req.cache_salt, [-1, req.rope_long_below])  # (no token id is negative)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = STEP_TOKENS
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    batching: str = "continuous"  # "continuous" | "static"
    pooling_share: float = 0.0  # pooling prompts' most of a decode step's time while any decodes (0: no limit)


@dataclass
class _Plan:
    """A step's decisions while they are being made; frozen into a SchedulerOutput at the end."""

    budget: int
    scheduled: list[tuple[Request, int, int, list[int]]] = field(default_factory=list)  # (req, start, new, drafts)
    preempted: list[str] = field(default_factory=list)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    pooling_left: int | None = None  # pooling prompt tokens this step may still take (None: no limit)

    def take(self, req: Request, num_new: int) -> int:
        """The tokens of `num_new` that `req` may compute this step (a pooling request within `pooling_left`)."""
        if req.pooling is None or self.pooling_left is None:
            return num_new
        num_new = min(num_new, self.pooling_left)
        self.pooling_left -= num_new
        return num_new


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        share = config.pooling_share if config.enable_chunked_prefill else 0.0  # (a whole prompt can wait only)
        self.pooling = PoolingShare(share) if share > 0 else None

    # -- queue management -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a finished or aborted request and release its blocks, first registering for the prefix cache the
        full blocks its computed tokens fill (a decode run's last ones were allocated as lookahead, unhashed)."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        computed = min(req.num_computed_tokens, req.num_tokens)  # a stop inside a run drops the tokens after it
        self.kv.cache_computed(req.request_id, req.all_token_ids, computed)
        self.kv.free(req.request_id)

    def requeue(self, req: Request) -> None:
        """Send a running request back to the front of the waiting queue with no blocks, to be recomputed: a
        preemption, or after a step that read blocks a failed sequence never wrote (`unwind_failed`)."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        self.waiting.insert(0, req)
        self.num_preemptions += 1

    def unwind_failed(self, so: SchedulerOutput, failed: set[str], spared: set[str]) -> list[Request]:
        """After a step in which the sequences `failed` failed: their blocks from their first token of the step on
        were hashed when scheduled but never written, so they lose their hashes. A sequence of the step that read
        one of them (a prefix hit on a prompt admitted just before it), unless `spared` (one that ends anyway),
        computed from garbage: its own new blocks lose their hashes too, and it is requeued to be recomputed, as
        after a preemption. Returns those requeued, for the core to reset."""
        broken = {b for s in so.scheduled if s.request_id in failed
                  for b in self.kv.forget_from(s.request_id, s.num_computed_tokens)}  # fmt: skip
        requeued = []
        for s in so.scheduled:
            req = self._running_by_id(s.request_id)
            if req is None or s.request_id in failed | spared or not broken & set(s.block_table):
                continue
            self.kv.forget_from(s.request_id, s.num_computed_tokens)
            self.requeue(req)
            requeued.append(req)
        return requeued

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _ordered(self, reqs: Iterable[Request]) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(reqs, key=lambda r: r.sort_key)
        return list(reqs)  # fcfs: queues are already in arrival order

    def observe_step(self, duration_s: float, num_steps: int, decode_rows: int, prompt_tokens: int) -> None:
        """How long the last step took, and what it computed (for the pooling prompts' share)."""
        if self.pooling is not None:
            self.pooling.observe(duration_s, num_steps, decode_rows, prompt_tokens)

    # -- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _Plan(self.config.max_num_batched_tokens)
        if self.pooling is not None and any(r.pooling is None and r.output_token_ids for r in self.running):
            plan.pooling_left = self.pooling.budget()  # streams decode: pooling prompts yield to them
        self.running = self._ordered(self.running)
        for req in list(self.running):
            if plan.budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = plan.take(req, min(remaining, plan.budget))
            if num_new <= 0:
                continue
            # drafts ride along when every known token fits; they take budget and unhashed lookahead slots
            drafts = req.spec_token_ids[: plan.budget - num_new] if num_new == remaining else []
            room = not drafts or self.kv.allocate_slots(
                req.request_id, req.all_token_ids, req.num_computed_tokens, num_new,
                num_lookahead_tokens=len(drafts), salt=prefix_salt(req),
            )  # fmt: skip
            if not room:
                drafts = []  # no room for their slots: no drafts this step, rather than preempt anyone for them
            if not self._allocate_running(req, num_new, plan, len(drafts)):
                continue
            plan.scheduled.append((req, req.num_computed_tokens, num_new, drafts))
            plan.budget -= num_new + len(drafts)
        if not plan.preempted and not (self.config.batching == "static" and self.running):
            self._admit_waiting(plan)
        steps = self._decode_runs(plan)
        table = self.kv.block_table
        scheduled = [
            ScheduledRequest(req.request_id, start, num_new + len(drafts), table(req.request_id), tuple(drafts))
            for req, start, num_new, drafts in plan.scheduled
        ]
        return SchedulerOutput(scheduled, plan.preempted, plan.num_cached_tokens, steps)

    def _decode_runs(self, plan: _Plan) -> int:
        """The decode steps every scheduled sequence takes this step: the least `multi_step_limit` among them where
        all may take several (see the top), else 1. The slots of a run are taken here; where one sequence cannot
        have them, the step is a plain one (the slots taken stay with their sequences, for their next steps)."""
        runs = [req.multi_step_limit for req, _, _, _ in plan.scheduled]
        run = min(runs, default=0)
        if run < 2 or self.waiting or len(runs) > MAX_SEQS_FOR_RUNS or plan.preempted:
            return 1
        if any(new != 1 or drafts for _, _, new, drafts in plan.scheduled):
            return 1
        for req, start, _, _ in plan.scheduled:
            if not self.kv.allocate_slots(req.request_id, req.all_token_ids, start, 1, num_lookahead_tokens=run - 1,
                                          salt=prefix_salt(req)):  # fmt: skip
                return 1
        return run

    def _allocate_running(self, req: Request, num_new: int, plan: _Plan, num_drafts: int = 0) -> bool:
        """Reserve blocks for `req`, preempting from the back of the running queue until it fits."""
        while not self.kv.allocate_slots(
            req.request_id, req.all_token_ids, req.num_computed_tokens, num_new, num_lookahead_tokens=num_drafts,
            salt=prefix_salt(req),
        ):  # fmt: skip
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, plan: _Plan) -> None:
        self.requeue(req)
        plan.preempted.append(req.request_id)
        # a victim already scheduled this step must not run: its blocks are gone
        plan.scheduled = [s for s in plan.scheduled if s[0] is not req]

    def _admit_waiting(self, plan: _Plan) -> None:
        for req in self._ordered(self.waiting):
            if plan.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._waiting_for_sibling(req):
                continue
            num_cached, blocks = self._cached_prefix(req)
            num_new = req.num_tokens - num_cached
            if num_new > plan.budget and not self.config.enable_chunked_prefill:
                self.kv.free(req.request_id)  # drop what a fork may have shared (its next try forks again)
                break  # the whole prompt must fit in one step; wait for a lighter step
            num_new = plan.take(req, min(num_new, plan.budget))
            if num_new <= 0 and req.pooling is not None:
                self.kv.free(req.request_id)  # (what a fork may have shared)
                continue  # a pooling prompt past this step's share: the requests behind it may still come in
            if not self.kv.allocate_slots(req.request_id, req.all_token_ids, num_cached, num_new, blocks,
                                          salt=prefix_salt(req)):  # fmt: skip
                self.kv.free(req.request_id)  # drop what a fork may have shared
                break  # no room: it waits; running requests are never preempted for newcomers
            self.waiting.remove(req)
            self.running.append(req)
            plan.scheduled.append((req, num_cached, num_new, []))
            plan.num_cached_tokens[req.request_id] = num_cached
            plan.budget -= num_new

    def _waiting_for_sibling(self, req: Request) -> bool:
        """A later `n > 1` sample waits while the first sample's prompt is still being computed."""
        sibling = self._running_by_id(req.fork_of)
        return sibling is not None and sibling.num_computed_tokens < sibling.num_prompt_tokens

    def _running_by_id(self, request_id: str | None) -> Request | None:
        if request_id is None:
            return None
        return next((r for r in self.running if r.request_id == request_id), None)

    def _cached_prefix(self, req: Request) -> tuple[int, list[int]]:
        """(tokens already computed elsewhere, their blocks): a sibling's prompt blocks or a prefix-cache hit."""
        sibling = self._running_by_id(req.fork_of)
        if sibling is not None and not req.output_token_ids:
            shared = self.kv.fork(sibling.request_id, req.request_id, req.num_prompt_tokens - 1)
            if shared:
                return shared, []
        if req.params.prompt_logprobs is not None or req.no_prefix_cache:
            return 0, []  # prompt logprobs (mean pooling) read every prompt position's logits (hidden state)
        blocks, num_cached = self.kv.get_computed_blocks(req.all_token_ids, prefix_salt(req))
        return num_cached, blocks

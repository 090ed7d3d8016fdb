"""The scheduler: who runs this step and how many tokens each computes. Never touches tensors.

Token-centric (as vLLM v1): a request only has `num_computed_tokens` and `num_tokens`. A prefill, a
prefill chunk, a decode and a prefix-cache hit are all "compute the next k tokens". Each step:

1. Running requests first, in policy order, each taking up to its remaining tokens from the step's
   `max_num_batched_tokens` budget (decodes take 1; a long prompt takes what is left: chunked prefill).
   When the KV pool has no room, the lowest-priority / newest running request is preempted: its blocks are
   freed and it goes back to the front of the waiting queue to be recomputed later. Never dropped.
2. Then waiting requests, in policy order, while the budget, `max_num_seqs` and the pool allow. A new
   request first looks up its prompt in the prefix cache; `n > 1` siblings share the first sample's prompt
   blocks once they are computed.

`batching="static"` admits nothing while anything runs: the whole batch drains first (the baseline).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.kv_cache import KVCacheManager
from tokenmill.types import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    batching: str = "continuous"  # "continuous" | "static"


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computed this step, starting at request.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # request id -> block ids (paged only)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | None) -> None:
        self.config = config
        self.kv = kv  # None: the contiguous / recompute baselines, which keep no block accounting
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.kv is not None:
            self.kv.free(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _ordered(self, reqs: Iterable[Request]) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(reqs, key=lambda r: r.sort_key)
        return list(reqs)  # fcfs: queues are already in arrival order

    # -- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running = self._ordered(self.running)
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            if not self._allocate_running(req, num_new, out):
                continue
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        if not out.preempted and not (self.config.batching == "static" and self.running):
            self._admit_waiting(budget, out)
        if self.kv is not None:
            out.block_tables = {s.request.request_id: self.kv.block_table(s.request.request_id) for s in out.scheduled}
        return out

    def _allocate_running(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Reserve blocks for `req`, preempting from the back of the running queue until it fits."""
        if self.kv is None:
            return True
        while not self.kv.allocate_slots(req.request_id, req.all_token_ids, req.num_computed_tokens, num_new):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        if self.kv is not None:
            self.kv.free(req.request_id)
        req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)
        out.preempted.append(req.request_id)
        # a victim already scheduled this step must not run: its blocks are gone
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        for req in self._ordered(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._waiting_for_sibling(req):
                continue
            num_cached, blocks = self._cached_prefix(req)
            num_new = req.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break  # the whole prompt must fit in one step; wait for a lighter step
            num_new = min(num_new, budget)
            if self.kv is not None and not self.kv.allocate_slots(
                req.request_id, req.all_token_ids, num_cached, num_new, blocks
            ):
                self.kv.free(req.request_id)  # drop what a fork may have shared
                break  # no room: it waits; running requests are never preempted for newcomers
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.metrics.num_preemptions == 0 and req.index == 0:
                req.metrics.num_cached_tokens = num_cached
            self.waiting.remove(req)
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

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
        if self.kv is None:
            return 0, []
        sibling = self._running_by_id(req.fork_of)
        if sibling is not None and req.num_computed_tokens == 0 and not req.output_token_ids:
            shared = self.kv.fork(sibling.request_id, req.request_id, req.num_prompt_tokens - 1)
            if shared:
                return shared, []
        if req.params.prompt_logprobs is not None:
            return 0, []  # prompt logprobs need logits at every prompt position: compute them all
        blocks, num_cached = self.kv.get_computed_blocks(req.all_token_ids)
        return num_cached, blocks

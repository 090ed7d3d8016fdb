"""The synchronous engine loop, and the one owner of request state.

One `step()`: the scheduler decides who runs -> the core describes that batch (`ModelInput`) -> the runner
runs the model once and samples -> `update_from_output` appends tokens, advances `num_computed_tokens`,
checks stop tokens, lengths and (through the output processor) stop strings, and frees what finished.
A pooling request (pooling_params.py) runs in the same batches: its prompt is computed like any prefill, and the
step that reaches its end gives its pooled vector and finishes it.

Only this class writes a `Request`. The scheduler owns its queues and the KV manager; the runner owns tensors
and never sees a request; the output processor detokenizes and reports. `snapshot()` publishes the numbers
other threads may read.
"""

from __future__ import annotations

import time
from dataclasses import replace
from itertools import count

from tokenmill.engine.isolation import execute_isolated
from tokenmill.engine.lookahead import draft_requests, run_limit
from tokenmill.engine.lora_registry import LoraRegistry
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request_tokens import (
    advance_grammar,
    advance_pooling,
    append_token,
    count_drafts,
    keep_tokens,
    new_sequences,
    pooling_output,
    recompute,
)
from tokenmill.engine.sequence_input import sequence_input
from tokenmill.engine.snapshot import engine_snapshot
from tokenmill.engine.thinking import ThinkingBudgets
from tokenmill.engine.validation import check_adapter, check_generates, check_pooling, output_budget
from tokenmill.kv_cache import KVManager
from tokenmill.memory import trim
from tokenmill.metrics import EngineSnapshot, EngineStats, StepStats
from tokenmill.outputs import RequestMetrics, RequestOutput
from tokenmill.pooling_params import ModelTask, PoolingParams
from tokenmill.runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler
from tokenmill.spec_decode import Proposer
from tokenmill.step_plan import model_input
from tokenmill.structured_output import StructuredOutputManager
from tokenmill.tokenizer import Tokenizer
from tokenmill.types import (
    EngineRequest,
    ModelInput,
    Request,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

GENERATE = ModelTask()  # a model that generates and pools nothing


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        proposer: Proposer | None = None,
        spec_off_above: int | None = None,  # no drafts while more sequences than this run
        num_scheduler_steps: int = 1,  # decode steps in one call, where the runner can (Request.multi_step_limit)
        task: ModelTask = GENERATE,  # generation and/or pooling requests (a pooler: the runner's)
        hidden_size: int = 0,  # the longest embedding a pooling request may ask for
        max_lora_rank: int = 16,  # the largest rank a LoRA adapter may have (where the runner serves adapters)
        detokenize: bool = True,  # False: outputs of tokens alone; the server makes the text (server/engine_process.py)
        rope_long_from: int | None = None,  # LongRoPE's original context: a longer prompt rotates long throughout
    ) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.scheduler_steps = num_scheduler_steps if runner.runs_decode_steps else 1
        self.proposer, self.spec_off_above = proposer, spec_off_above  # speculative decoding (spec_decode/)
        self.kv: KVManager = scheduler.kv
        self.output = OutputProcessor(tokenizer if detokenize else None)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.eos_token_ids = eos_token_ids
        self.task, self.hidden_size, self.rope_long_from = task, hidden_size, rope_long_from
        # grammars' matchers; the Rust tokenizer is read at the first compile (a deferred one is built only then)
        self.structured = StructuredOutputManager(lambda: tokenizer.rust, vocab_size, eos_token_ids)
        self.thinking = ThinkingBudgets()  # thinking budgets' counts (engine/thinking.py)
        # the LoRA adapters served, where the runner's model has them attached (engine/lora_registry.py)
        self.lora = LoraRegistry(runner, runner.lora, max_lora_rank) if runner.lora is not None else None
        self.requests: dict[str, list[Request]] = {}  # parent request id -> its sequences
        self._seqs: dict[str, Request] = {}  # sequence (request) id -> sequence
        self.stats = EngineStats()
        self._step_running = False
        self._ids = count()
        self._arrivals = count()

    # -- what the callers see ---------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, lora: str | None = None) -> int:
        """Reject a request that can never run; return its output budget (max_tokens).

        Reads only facts fixed at construction (and the published adapter names), so any thread may call it."""
        self.check_lora(lora)
        check_generates(self.task)
        return output_budget(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.kv)

    def check_lora(self, lora: str | None) -> None:
        """A request may name `lora` (LoraError 404 naming the loaded adapters otherwise). Any thread."""
        check_adapter(lora, None if self.lora is None else (a.name for a in self.lora.loaded))

    def validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        """Reject a pooling request this model cannot serve or that can never run (any thread may call it)."""
        check_pooling(prompt_token_ids, params, self.task, self.hidden_size, self.vocab_size, self.max_model_len,
                      self.kv)  # fmt: skip

    def add_request(self, request: EngineRequest) -> None:
        """Queue one validated user request (its n sequences)."""
        request_id, params = request.request_id, request.params
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        metrics = RequestMetrics(
            arrival_time=request.arrival_time or time.perf_counter(),
            tokenization_ms=request.tokenization_ms,
            num_prompt_tokens=len(request.prompt_token_ids),
        )
        children = new_sequences(request, self.eos_token_ids, metrics, next(self._arrivals), self._pools_every_row,
                                 self.rope_long_from)  # fmt: skip
        grammar = request.grammar
        if grammar is None and params.structured_outputs is not None:
            grammar = self.structured.compile(params.structured_outputs)
        if request.lora is not None:  # (last of what may raise: from here on the request is the core's)
            self.check_lora(request.lora)
            assert self.lora is not None
            adapter = self.lora.take(request.lora, [c.request_id for c in children])
            for child in children:
                child.lora_id, child.cache_salt = adapter.adapter_id, adapter.digest
        self.requests[request_id] = children
        if grammar is not None:
            for child in children:
                self.structured.add(child.request_id, grammar)
        elif params.thinking is not None:  # under a grammar, the grammar decides every token
            for child in children:
                self.thinking.add(child.request_id, params.thinking)
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        if request.pooling is None:  # (a pooling request has no text to make)
            self.output.add_request(request.prompt, children)
        for child in children:
            self._seqs[child.request_id] = child
            self.scheduler.add(child)

    def close(self) -> None:
        """Stop what runs beside the engine (tensor-parallel workers); the prefix cache's pool blocks go to disk."""
        if not self._step_running:
            self.kv.flush(self.runner.kv.paged)
        self.runner.close()

    def idle(self) -> None:
        """No request is left: give back the memory only running steps use (the runner's scratch, then the
        allocator's freed pages: memory.trim)."""
        self.runner.idle()
        trim()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a user request (all its sequences), release everything it holds, return its final output.

        None if the request is unknown (already finished, or never added)."""
        children = self.requests.pop(request_id, None)
        if children is None:
            return None
        for req in children:
            if not req.finished:
                req.finish_reason = "abort"
            self._release(req)
        self.stats.num_aborted += 1
        return self._final_output(request_id, children)

    def stop_sequence(self, parent_id: str, index: int, num_tokens: int, stop: str) -> list[RequestOutput]:
        """A stop string found by the server (which makes the text: server/engine_process.py) ends sample `index` of
        `parent_id` after its first `num_tokens` output tokens, as one found here ends it; the outputs it makes.
        Nothing where that sample has finished or the request is gone."""
        req = next((r for r in self.requests.get(parent_id, []) if r.index == index), None)
        if req is None or req.finished:
            return []
        self.stats.generation_tokens -= keep_tokens(req, num_tokens)
        req.finish_reason, req.stop_reason = "stop", stop
        return self._outputs([parent_id])

    def snapshot(self) -> EngineSnapshot:
        """The engine's numbers as one frozen object, for readers on other threads."""
        return engine_snapshot(self.scheduler, self.stats)

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.requests:
            return []
        self._step_running = True  # until the step ends: a step that raised may leave hashed blocks never written
        outputs = self._step()
        self._step_running = False
        return outputs

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        so = self.scheduler.schedule()
        self.kv.move_blocks(self.runner.kv.paged)  # the prefix cache's tiers: evicted blocks out, hits in
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if not so.scheduled:
            return self.update_from_output(so, RunnerOutput(), start)
        batch = {s.request_id: self._seqs[s.request_id] for s in so.scheduled}
        result, failed = execute_isolated(self.runner, so, self._model_input)
        if failed:  # those requests end with their error; the rest of the step stands, but for what they broke
            gone = set(failed) | self._unwind_failed(so, failed, result)
            so = replace(so, scheduled=[s for s in so.scheduled if s.request_id not in gone])
        outputs = self.update_from_output(so, result, start) + self._fail(failed)
        self._propose()
        self._plan_decode_runs()
        decodes = sum(1 for s in so.scheduled if batch[s.request_id].output_token_ids and s.num_new_tokens == 1)
        step = StepStats(len(so.scheduled), so.num_batched_tokens, so.num_steps * decodes, self.kv.usage,
                         time.perf_counter() - start)  # fmt: skip
        self.stats.record(step)
        self.scheduler.observe_step(step.duration_s, so.num_steps, decodes, step.num_tokens - step.num_decode_tokens)
        return outputs

    def _unwind_failed(self, so: SchedulerOutput, failed: dict[str, str], result: RunnerOutput) -> set[str]:
        """The sequences of the step that read blocks a failed one never wrote start over (Scheduler.unwind_failed):
        their results are dropped. Returns their ids."""
        failed_parents = {self._seqs[rid].parent_id for rid in failed}
        siblings = {r.request_id for p in failed_parents for r in self.requests[p]}  # they end with the failure
        requeued = self.scheduler.unwind_failed(so, set(failed), siblings)
        for req in requeued:
            result.sampled.pop(req.request_id, None)
            result.prompt_logprobs.pop(req.request_id, None)
            recompute(req)
        return {req.request_id for req in requeued}

    def _fail(self, failed: dict[str, str]) -> list[RequestOutput]:
        """End the user requests whose sequences failed: every sample, with the error, blocks released."""
        outputs = []
        parents = {rid: self._seqs[rid].parent_id for rid in failed}  # (read before any is released below)
        for parent_id in dict.fromkeys(parents.values()):
            error = next(msg for rid, msg in failed.items() if parents[rid] == parent_id)
            children = self.requests.pop(parent_id)
            for req in children:
                req.finish_reason = req.finish_reason or "error"
                self._release(req)
            final = self._final_output(parent_id, children)
            if final is not None:
                outputs.append(replace(final, error=error))
            self.stats.num_failed += 1
        return outputs

    def _model_input(self, so: SchedulerOutput) -> ModelInput:
        seqs = [sequence_input(self._seqs[s.request_id], s) for s in so.scheduled]
        sampling = [s.request_id for s in seqs if s.sampling is not None]
        forced = {rid: t for rid in sampling if (t := self.thinking.forced(rid)) is not None}
        constrained = [rid for rid in sampling if self.structured.has(rid) or rid in forced]
        if not constrained:
            return model_input(seqs, so.num_steps)
        rows = {rid: i for i, rid in enumerate(constrained)}
        return model_input(seqs, so.num_steps, self.structured.bitmask(constrained, forced), rows)

    def update_from_output(
        self, so: SchedulerOutput, result: RunnerOutput, scheduled_at: float | None = None
    ) -> list[RequestOutput]:
        """Apply one step to request state: the only place requests change while they run."""
        now = time.perf_counter()
        for request_id in so.preempted:
            recompute(self._seqs[request_id])
        for request_id, num_cached in so.num_cached_tokens.items():
            req = self._seqs[request_id]
            if req.metrics.num_preemptions == 0 and req.index == 0:
                req.metrics.num_cached_tokens = num_cached
        for s in so.scheduled:
            self._advance(self._seqs[s.request_id], s, so.num_steps, result, scheduled_at or now, now)
        for req in (self._seqs[s.request_id] for s in so.scheduled):
            if req.short_rope_steps == 0 and not req.finished:  # past LongRoPE's original context: computed again
                req.rope_long_below = req.rope_long_from  # with the long factors, as transformers' Phi-3 generate
                self.scheduler.requeue(req)
                recompute(req)
        return self._outputs(list(dict.fromkeys(self._seqs[s.request_id].parent_id for s in so.scheduled)))

    def _advance(self, req: Request, s: ScheduledRequest, num_steps: int, result: RunnerOutput, scheduled_at: float,
                 now: float) -> None:  # fmt: skip
        """One scheduled sequence's share of the step: what it computed, its prompt logprobs, its drafts, and its
        sampled tokens appended until one of them finishes it."""
        req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or scheduled_at
        if result.forward_path is not None:
            steps = req.metrics.forward_steps
            steps[result.forward_path] = steps.get(result.forward_path, 0) + 1
        retains_kv = self.runner.kv.retains_kv
        if req.pooling is not None:
            advance_pooling(req, s.num_computed_tokens + s.num_new_tokens, result, retains_kv)
            return
        new_tokens = result.sampled.get(req.request_id, [])
        num_drafts = len(s.spec_token_ids)
        # kept drafts, and a decode run's tokens before its last: their keys/values stand
        accepted = max(len(new_tokens) - 1, 0) if num_drafts or num_steps > 1 else 0
        computed = s.num_computed_tokens + s.num_new_tokens - num_drafts + accepted
        req.num_computed_tokens = computed if retains_kv else 0
        if req.prompt_logprobs is not None and req.request_id in result.prompt_logprobs:
            req.prompt_logprobs += result.prompt_logprobs[req.request_id]
        if num_drafts:
            count_drafts(req, num_drafts, accepted)
            self.stats.spec_draft_tokens += num_drafts
            self.stats.spec_accepted_tokens += accepted
        for token, logprobs in new_tokens:
            append_token(req, token, logprobs, now, self.max_model_len)
            self.stats.generation_tokens += 1
            self.thinking.accept(req.request_id, token)
            if self.structured.has(req.request_id):
                advance_grammar(self.structured, req, token)
            if req.finished:  # a stop inside an accepted run: the rest is dropped
                break

    def _outputs(self, parents: list[str]) -> list[RequestOutput]:
        """The step's outputs for these user requests (stop strings found as their text is made), and what finished
        released."""
        pooled = [p for p in parents if self.requests[p][0].pooling is not None]
        parents = [p for p in parents if self.requests[p][0].pooling is None]
        for parent_id in parents:
            for req in self.requests[parent_id]:
                hit = self.output.detokenize(parent_id, req.index)
                if hit is not None:
                    self.stats.generation_tokens -= keep_tokens(req, hit.num_tokens)
                    req.finish_reason, req.stop_reason = "stop", hit.stop
        outputs = self.output.make_outputs(parents)
        outputs += [pooling_output(p, self.requests[p][0]) for p in pooled if self.requests[p][0].finished]
        for out in outputs:
            if out.finished:
                for req in self.requests.pop(out.request_id, []):
                    self._release(req)
                self.stats.num_completed += 1
            else:  # a finished sample of an n > 1 request frees its blocks right away
                for req in self.requests[out.request_id]:
                    if req.finished:
                        self._release(req)
        return outputs

    @property
    def _pools_every_row(self) -> bool:
        """The pooler reads every prompt position's hidden state (mean pooling): none may come from the prefix cache."""
        return self.task.pooling is not None and self.task.pooling.pooling == "mean"

    def _final_output(self, parent_id: str, children: list[Request]) -> RequestOutput | None:
        """The last output of an aborted or failed request (None where the output processor never knew it)."""
        if children[0].pooling is not None:
            return pooling_output(parent_id, children[0])
        return self.output.abort(parent_id)

    def _propose(self) -> None:
        """Drafts for every running sequence that decodes next step (none above `spec_off_above` sequences, the
        waiting ones included: while a burst is still being admitted, its first sequences' verify rows would slow
        the others' prefill; Xeon, 16 streams with n-gram drafts: TTFT p50 +0.3 s)."""
        if self.proposer is None:
            return
        running = self.scheduler.running
        busy = len(running) + len(self.scheduler.waiting)
        off = self.spec_off_above is not None and busy > self.spec_off_above
        asks = draft_requests(running, off, self.structured, self.thinking, self.max_model_len)
        for req in running:
            if req.spec_skip > 0:
                req.spec_skip -= 1
        drafts = self.proposer.propose_batch(asks) if asks else {}
        for req in running:  # every running sequence: none keeps last step's drafts
            req.spec_token_ids = drafts.get(req.request_id, [])

    def _plan_decode_runs(self) -> None:
        """How many decode steps each running sequence may take in one call next step (the scheduler decides
        whether the step takes them)."""
        if self.scheduler_steps < 2:
            return
        for req in self.scheduler.running:
            req.multi_step_limit = run_limit(req, self.scheduler_steps, self.max_model_len, self.structured,
                                             self.thinking)  # fmt: skip

    def _release(self, req: Request) -> None:
        req.metrics.finished_time = req.metrics.finished_time or time.perf_counter()
        if req.lora_id and self.lora is not None:
            self.lora.release(req.lora_id, req.request_id)
        self.scheduler.remove(req)
        self.runner.release(req.request_id)
        self.structured.remove(req.request_id)
        self.thinking.remove(req.request_id)
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        self._seqs.pop(req.request_id, None)

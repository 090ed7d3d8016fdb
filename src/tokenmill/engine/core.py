"""The synchronous engine loop. One `step()`: pick what runs -> run the model once -> append tokens -> finish
what stopped -> hand back outputs.

Scheduling here is the simplest token-centric policy: every unfinished request runs every step and
computes all of its not-yet-computed tokens (its whole prompt on the first step, one token after that).
With `kv_cache="none"` nothing stays computed, so every step recomputes the whole context: the textbook
baseline that shows what a KV cache buys.
"""

from __future__ import annotations

import time
from itertools import count

from tokenmill.engine.output import OutputProcessor
from tokenmill.outputs import RequestMetrics, RequestOutput
from tokenmill.runner import ModelRunner, RunnerOutput, ScheduledRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer
from tokenmill.types import Request, RequestStatus


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        use_cache: bool = True,
    ) -> None:
        self.runner = runner
        self.output = OutputProcessor(tokenizer)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.eos_token_ids, self.use_cache = eos_token_ids, use_cache
        self.requests: dict[str, Request] = {}  # running sequences by request id
        self._ids = count()

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        tokenization_ms: float = 0.0,
    ) -> None:
        """Validate and queue one user request (n sequences). Raises ValueError when it can never run."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range: allowed [0, {self.vocab_size - 1}]")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max(max_tokens, 1) > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion)."
            )
        if any(r.parent_id == request_id for r in self.requests.values()):
            raise ValueError(f"request id {request_id!r} is already running")
        metrics = RequestMetrics(
            arrival_time=arrival_time or time.perf_counter(),
            tokenization_ms=tokenization_ms,
            num_prompt_tokens=num_prompt,
        )
        children = []
        for i in range(params.n):
            child = Request(
                request_id=f"{request_id}-{i}" if params.n > 1 else request_id,
                parent_id=request_id,
                index=i,
                prompt_token_ids=list(prompt_token_ids),
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                metrics=metrics,
                seed=None if params.seed is None else params.seed + i,
                logprobs=[] if params.logprobs is not None else None,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            )
            self.requests[child.request_id] = child
            children.append(child)
        self.output.add_request(prompt, children)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> None:
        """Stop a user request (all its sequences) and release everything it holds."""
        for req in [r for r in self.requests.values() if r.parent_id == request_id]:
            req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
            self._free(req)
        self.output.abort(request_id)

    def step(self) -> list[RequestOutput]:
        if not self.requests:
            return []
        now = time.perf_counter()
        scheduled = []
        for req in self.requests.values():
            if req.status is RequestStatus.WAITING:
                req.status = RequestStatus.RUNNING
                req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            scheduled.append(ScheduledRequest(req, req.num_tokens - req.num_computed_tokens))
        result = self.runner.execute(scheduled)
        self._update(scheduled, result)
        parents = list(dict.fromkeys(s.request.parent_id for s in scheduled))
        outputs = self.output.process(parents)
        for s in scheduled:
            if s.request.finished:
                self._free(s.request)
        return outputs

    def _update(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> None:
        now = time.perf_counter()
        for s in scheduled:
            req = s.request
            req.num_computed_tokens = req.num_computed_tokens + s.num_new_tokens if self.use_cache else 0
            if req.prompt_logprobs is not None and req.request_id in result.prompt_logprobs:
                req.prompt_logprobs += result.prompt_logprobs[req.request_id]
            if req.request_id not in result.sampled:
                continue
            token, logprobs = result.sampled[req.request_id]
            req.output_token_ids.append(token)
            if req.logprobs is not None and logprobs is not None:
                req.logprobs.append(logprobs)
                req.cumulative_logprob += logprobs[token]
            m = req.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            m.num_generated_tokens += 1
            self._check_stop(req, token)

    def _check_stop(self, req: Request, token: int) -> None:
        reason: str | None = None
        if len(req.output_token_ids) >= req.params.min_tokens:
            if not req.params.ignore_eos and token in req.eos_token_ids:
                reason = "stop"
            elif token in req.params.stop_token_ids:
                reason, req.stop_reason = "stop", token
        if reason is None and (len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def _free(self, req: Request) -> None:
        req.metrics.finished_time = req.metrics.finished_time or time.perf_counter()
        self.runner.free(req.request_id)
        self.requests.pop(req.request_id, None)

"""The synchronous engine loop. One `step()`: schedule -> run the model once and sample -> append tokens and
check stops -> detokenize and check stop strings -> release what finished -> hand back outputs.

The core owns request lifetimes; the scheduler decides who runs; the runner owns the tensors. With
`kv_cache="none"` nothing stays computed, so every step recomputes each running request's whole context:
the textbook baseline that shows what a KV cache buys.
"""

from __future__ import annotations

import time
from itertools import count

from tokenmill.config import EngineConfig
from tokenmill.engine.loading import LoadedModel
from tokenmill.engine.output import OutputProcessor
from tokenmill.kv_cache import KVCacheManager
from tokenmill.metrics import EngineStats, StepStats
from tokenmill.outputs import RequestMetrics, RequestOutput
from tokenmill.runner import ModelRunner, RunnerOutput, plan_num_kv_blocks
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.tokenizer import Tokenizer
from tokenmill.types import Request, RequestStatus


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.kv: KVCacheManager | None = scheduler.kv
        self.output = OutputProcessor(tokenizer)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.eos_token_ids = eos_token_ids
        self.recompute = runner.kv_mode == "none"
        self.requests: dict[str, list[Request]] = {}  # parent request id -> its sequences
        self.stats = EngineStats()
        self._ids = count()
        self._arrivals = count()

    @classmethod
    def build(cls, loaded: LoadedModel, cfg: EngineConfig) -> EngineCore:
        """Wire a loaded model into runner + KV cache + scheduler as `cfg` says."""
        max_len = loaded.max_model_len
        chunked = cfg.enable_chunked_prefill and cfg.kv_cache != "none"  # recompute keeps no partial prefill
        budget = cfg.max_num_batched_tokens if chunked else max(cfg.max_num_batched_tokens, max_len)
        kv = None
        num_blocks = 0
        if cfg.kv_cache == "paged":
            num_blocks = plan_num_kv_blocks(
                loaded.model, loaded.device, cfg.block_size, max_len, cfg.max_num_seqs,
                cfg.num_kv_blocks, cfg.kv_cache_memory_gb,
            )  # fmt: skip
            kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        runner = ModelRunner(loaded.model, loaded.device, cfg.kv_cache, num_blocks, cfg.block_size, cfg.seed)
        scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, budget, chunked, cfg.scheduling_policy, cfg.batching), kv
        )
        return cls(runner, scheduler, loaded.tokenizer, loaded.config.vocab_size, max_len, loaded.eos_token_ids)

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Reject a request that can never run; return its output budget (max_tokens)."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range: allowed [0, {self.vocab_size - 1}]")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if max_tokens < 1 or num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + max(max_tokens, 1)} tokens ({num_prompt} in the messages, {max(max_tokens, 1)} in the "
                "completion). Please reduce the length of the prompt or the completion."
            )
        if self.kv is not None:
            needed = self.kv.num_blocks_needed(num_prompt + max_tokens)
            if needed > self.kv.num_blocks:
                raise ValueError(
                    f"this request needs {needed} KV blocks ({num_prompt} prompt + {max_tokens} completion tokens) "
                    f"but the whole pool has {self.kv.num_blocks}; lower max_tokens or raise num_kv_blocks / "
                    "kv_cache_memory_gb"
                )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        tokenization_ms: float = 0.0,
        priority: int = 0,
    ) -> None:
        """Validate and queue one user request (its n sequences). Raises ValueError when it can never run."""
        max_tokens = self.validate(prompt_token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        metrics = RequestMetrics(
            arrival_time=arrival_time or time.perf_counter(),
            tokenization_ms=tokenization_ms,
            num_prompt_tokens=len(prompt_token_ids),
        )
        arrival = next(self._arrivals)
        children = []
        for i in range(params.n):
            children.append(
                Request(
                    request_id=f"{request_id}-{i}" if params.n > 1 else request_id,
                    parent_id=request_id,
                    index=i,
                    prompt_token_ids=list(prompt_token_ids),
                    params=params,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    metrics=metrics,
                    arrival_order=arrival,
                    priority=priority,
                    seed=None if params.seed is None else params.seed + i,
                    fork_of=f"{request_id}-0" if i > 0 else None,
                    logprobs=[] if params.logprobs is not None else None,
                    prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                )
            )
        self.requests[request_id] = children
        self.stats.prompt_tokens += len(prompt_token_ids)
        self.output.add_request(prompt, children)
        for child in children:
            self.scheduler.add(child)

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
                req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
            self._release(req)
        self.stats.num_aborted += 1
        return self.output.abort(request_id)

    def step(self) -> list[RequestOutput]:
        if not self.requests:
            return []
        start = time.perf_counter()
        so = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if not so.scheduled:
            return []
        for s in so.scheduled:
            s.request.metrics.first_scheduled_time = s.request.metrics.first_scheduled_time or start
        result = self.runner.execute(so)
        self._update(so, result)
        parents = list(dict.fromkeys(s.request.parent_id for s in so.scheduled))
        outputs = self.output.process(parents)
        for out in outputs:
            if out.finished:
                for req in self.requests.pop(out.request_id, []):
                    self._release(req)
                self.stats.num_completed += 1
            else:  # a finished sample of an n > 1 request frees its blocks right away
                for req in self.requests[out.request_id]:
                    if req.finished:
                        self._release(req)
        self.stats.record(
            StepStats(
                batch_size=len(so.scheduled),
                num_tokens=so.num_batched_tokens,
                num_decode_tokens=sum(1 for s in so.scheduled if s.request.output_token_ids and s.num_new_tokens == 1),
                kv_usage=self.kv.usage if self.kv is not None else 0.0,
                duration_s=time.perf_counter() - start,
            )
        )
        return outputs

    def _update(self, so: SchedulerOutput, result: RunnerOutput) -> None:
        now = time.perf_counter()
        for s in so.scheduled:
            req = s.request
            req.num_computed_tokens = 0 if self.recompute else req.num_computed_tokens + s.num_new_tokens
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
            m.token_times.append(now)
            m.num_generated_tokens += 1
            self.stats.generation_tokens += 1
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

    def _release(self, req: Request) -> None:
        req.metrics.finished_time = req.metrics.finished_time or time.perf_counter()
        self.scheduler.finish(req)
        self.runner.free(req.request_id)

"""A user request's sequences as the core makes them, and what a step's results do to one sequence: its sampled tokens
appended (and, past a stop string, taken back), its drafts counted, its grammar advanced, a requeued sequence
started over, a pooling request's progress and its one output.

These are the engine core's own writes to a `Request`, kept apart so that `EngineCore.update_from_output` reads as
the order of a step's effects; only the core calls them (types.py: a `Request` has one writer).
"""

from __future__ import annotations

import logging
import time

from tokenmill.outputs import PoolingOutput, RequestMetrics, RequestOutput
from tokenmill.structured_output import StructuredOutputManager
from tokenmill.types import EngineRequest, Request, RunnerOutput

log = logging.getLogger("tokenmill.engine")


def new_sequences(request: EngineRequest, eos_token_ids: frozenset[int], metrics: RequestMetrics, arrival: int,
                  pools_every_row: bool, rope_long_from: int | None = None) -> list[Request]:  # fmt: skip
    """The n sequences of a validated user request, sharing its prompt and its metrics; `arrival` its place in the
    arrival order. A pooling request skips the prefix cache where the pooler reads every row's hidden state. With
    LongRoPE (`rope_long_from`: the original context), a prompt longer than that rotates by the long factors from
    position 0, as HF's model does over such a prompt (Request.rope_long_below)."""
    request_id, params = request.request_id, request.params
    prompt = list(request.prompt_token_ids)  # NOTE: one list for all n samples; nothing writes a prompt
    long_below = rope_long_from if rope_long_from is not None and len(prompt) > rope_long_from else 0
    return [
        Request(
            request_id=f"{request_id}-{i}" if params.n > 1 else request_id,
            parent_id=request_id,
            index=i,
            prompt_token_ids=prompt,
            params=params,
            max_tokens=request.max_tokens,
            eos_token_ids=eos_token_ids,
            metrics=metrics,
            arrival_order=arrival,
            priority=request.priority,
            seed=None if params.seed is None else params.seed + i,
            fork_of=f"{request_id}-0" if i > 0 else None,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            pooling=request.pooling,
            no_prefix_cache=request.pooling is not None and pools_every_row,
            rope_long_from=rope_long_from or 0,
            rope_long_below=long_below,
        )
        for i in range(params.n)
    ]


def append_token(req: Request, token: int, logprobs: dict[int, float] | None, now: float, max_model_len: int) -> None:
    """`token` (with its logprobs, where asked for) at the end of `req`'s output; its finish reason where the token
    is a stop (EOS or a stop token, past min_tokens) or reaches max_tokens or the context length."""
    req.output_token_ids.append(token)
    if req.logprobs is not None and logprobs is not None:
        req.logprobs.append(logprobs)
        req.cumulative_logprob += logprobs[token]
    m = req.metrics
    m.first_token_time = m.first_token_time or now
    m.last_token_time = now
    m.token_times.append(now)
    m.num_generated_tokens += 1
    if len(req.output_token_ids) >= req.params.min_tokens:
        if not req.params.ignore_eos and token in req.eos_token_ids:
            req.finish_reason = "stop"
        elif token in req.params.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
    if not req.finished and (len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_model_len):
        req.finish_reason = "length"


def keep_tokens(req: Request, n: int) -> int:
    """Drop the output tokens after the first `n` (a decode run's or kept drafts' tokens past a stop string), as if
    they had never been appended: their logprobs, their share of the cumulative logprob and their counts go too.
    Returns how many went."""
    dropped = len(req.output_token_ids) - n
    if dropped <= 0:
        return 0
    del req.output_token_ids[n:]
    if req.logprobs is not None:
        del req.logprobs[n:]
        req.cumulative_logprob = sum((lp[t] for lp, t in zip(req.logprobs, req.output_token_ids)), 0.0)
    del req.metrics.token_times[-dropped:]
    req.metrics.num_generated_tokens -= dropped
    return dropped


def count_drafts(req: Request, num_drafts: int, accepted: int) -> None:
    """A verify step's drafts: counted, and the proposer's auto-off for this sequence. After two fruitless rounds in
    a row its drafting pauses for 2, 4, ... 64 steps, probing between pauses; a kept draft resets it."""
    req.metrics.num_draft_tokens += num_drafts
    req.metrics.num_accepted_tokens += accepted
    req.spec_misses = 0 if accepted else req.spec_misses + 1
    req.spec_skip = min(2 ** (req.spec_misses - 1), 64) if req.spec_misses >= 2 else 0


def advance_pooling(req: Request, computed: int, result: RunnerOutput, retains_kv: bool) -> None:
    """A pooling request's step: its prompt computed so far; its pooled vector, where the step ended its prompt."""
    req.num_computed_tokens = computed if retains_kv else 0
    vector = result.pooled.get(req.request_id)
    if vector is not None:
        req.pooled, req.finish_reason = vector, "stop"
        req.metrics.finished_time = time.perf_counter()


def pooling_output(parent_id: str, req: Request) -> RequestOutput:
    """A pooling request's one output: its result, or none where it did not finish (aborted, failed)."""
    pooled = PoolingOutput(req.pooled) if req.pooled is not None else None
    return RequestOutput(parent_id, None, req.prompt_token_ids, [], finished=True, metrics=req.metrics,
                         pooled=pooled)  # fmt: skip


def recompute(req: Request) -> None:
    """A requeued (preempted) request starts over: nothing of it is computed."""
    req.num_computed_tokens, req.multi_step_limit = 0, 0
    req.metrics.num_preemptions += 1


def advance_grammar(structured: StructuredOutputManager, req: Request, token: int) -> None:
    """Feed the sampled token to the request's grammar: the grammar's end is a stop."""
    if not structured.accept(req.request_id, token):  # the mask allowed it, so only a backend fault
        log.error("request %s: the grammar refused token %d it had allowed", req.request_id, token)
        req.finish_reason = req.finish_reason or "error"
    elif req.finish_reason in (None, "length") and structured.finished(req.request_id):
        req.finish_reason = "stop"  # the grammar's end on the last token allowed is its end, as EOS there is

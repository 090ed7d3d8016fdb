"""One OpenAI call's engine requests, read to the end or streamed as server-sent events.

A call (`/v1/completions` with a list of prompts, or one chat) is several engine requests. `merged` reads
them as one stream tagged by prompt index; `run_to_end` collects the finals and aborts everything when the
client goes away; `stream_events` turns the outputs into OpenAI's SSE chunks. Choices are numbered
prompt-major (prompt i, sample j -> index i * n + j), as OpenAI and vLLM do.

Must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenmill.engine.request_stream import EngineDeadError, RequestFailedError, RequestStream
from tokenmill.errors import LoraError
from tokenmill.metrics import PrometheusMetrics
from tokenmill.outputs import Logprobs, RequestMetrics, RequestOutput
from tokenmill.server.errors import APIError, error_body


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: a JSON (or literal string) `data:` line, with an optional `event:` name."""
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


@dataclass
class Call:
    """One HTTP call's engine requests and what to echo back."""

    kind: str  # "text_completion" | "chat.completion"
    id: str
    model: str  # what the responses carry: the served model's name, or the LoRA adapter's the request named
    prompts: list[list[int]]
    streams: list[RequestStream]
    n: int
    created: int
    metrics: PrometheusMetrics | None = None
    tracer: Any = None  # tracing.RequestTracer, or None
    echo_texts: list[str] = field(default_factory=list)
    cached_tokens: int = 0  # the finished requests' prompt tokens served from the prefix cache
    finished: list[RequestMetrics] = field(default_factory=list)  # the finished requests' metrics, for `timings`
    # a chat answer read by a reasoning parser: how many of an output's tokens are reasoning (AnswerPlan's count)
    reasoning_count: Callable[[Sequence[int]], int] | None = None
    base_model: str | None = None  # a LoRA adapter's base model (its metrics and traces count there)

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"

    def observe(self, out: RequestOutput) -> None:
        if out.finished and out.metrics is not None:
            self.cached_tokens += out.metrics.num_cached_tokens
            self.finished.append(out.metrics)
            if self.metrics is not None:
                # (a pooling request has no completions: it stopped at its prompt's end, or was aborted)
                reasons = [c.finish_reason for c in out.outputs] or ["stop" if out.pooled is not None else "abort"]
                self.metrics.observe_finished(out.metrics, reasons, self.base_model or self.model)
            if self.tracer is not None:
                self.tracer.finished(out, self.base_model or self.model)

    def usage(self, num_completion_tokens: int) -> dict[str, Any]:
        """OpenAI's usage, with `prompt_tokens_details.cached_tokens` (the prefix cache's share of the prompts, as
        OpenAI and vLLM report it)."""
        prompt = sum(len(p) for p in self.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": num_completion_tokens,
                "total_tokens": prompt + num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}  # fmt: skip

    def final_usage(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        """The usage of the finished requests: with a reasoning parser, also `completion_tokens_details.
        reasoning_tokens` (OpenAI's field; the tokens inside the thinking, its markers not counted)."""
        usage = self.usage(completion_tokens(finals))
        if self.reasoning_count is not None:
            count = self.reasoning_count
            thought = sum(count(c.token_ids) for o in finals.values() for c in o.outputs)
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}
        return usage


def timings(finished: list[RequestMetrics]) -> dict[str, Any]:
    """tokenmill's per-call figures (the `timings` field, as llama-server names its own): the first token's time
    from arrival, the decode rate after it, speculative drafts verified and kept, and the steps each forward path
    ran. A call of several requests reports the earliest first token and the rate over all of them."""
    ttfts = [(m.first_token_time - m.arrival_time) * 1000 for m in finished if m.first_token_time is not None]
    firsts = [m.first_token_time for m in finished if m.first_token_time is not None]
    lasts = [m.last_token_time for m in finished if m.last_token_time is not None]
    after_first = sum(max(m.num_generated_tokens - 1, 0) for m in finished)
    span = max(lasts) - min(firsts) if firsts and lasts else 0.0
    paths: dict[str, int] = {}
    for m in finished:
        for name, steps in m.forward_steps.items():
            paths[name] = paths.get(name, 0) + steps
    return {
        "ttft_ms": min(ttfts) if ttfts else None,
        "decode_tokens_per_sec": after_first / span if span > 0 and after_first else None,
        "draft_tokens": sum(m.num_draft_tokens for m in finished),
        "accepted_tokens": sum(m.num_accepted_tokens for m in finished),
        "forward_steps": paths,
    }


def completion_tokens(finals: dict[int, RequestOutput]) -> int:
    return sum(len(c.token_ids) for o in finals.values() for c in o.outputs)


async def merged(call: Call) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all the call's requests as they come, tagged with the prompt index."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # engine died: surface it to the caller
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(call.streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in call.streams:
            s.close()


async def run_to_end(call: Call, raw: Request) -> dict[int, RequestOutput]:
    """Collect the final outputs; if the client goes away first, abort everything (within ~0.1 s)."""
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async for i, out in merged(call):
            if out.finished:
                finals[i] = out
                call.observe(out)

    task = asyncio.create_task(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and await raw.is_disconnected():
            task.cancel()  # merged() closes the streams, which aborts the requests
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError(499, "client disconnected")
    try:
        task.result()
    except (RequestFailedError, EngineDeadError) as e:
        raise APIError(500, f"generation failed: {e}") from None
    except LoraError as e:  # its adapter was unloaded after the request was checked, before the engine took it
        raise APIError(e.status, str(e), param="model") from None
    return finals


# One choice of a streamed chunk (completions and chat differ in shape): (index, new token ids, their logprobs or
# None, new text, finish reason, first chunk of this choice, stop reason: the stop string or token id that ended
# it, as vLLM's `stop_reason`) -> choice, or None when there is nothing to send yet (its tokens and logprobs then
# go with the choice's next chunk)
ChoiceBuilder = Callable[
    [int, list[int], list[Logprobs | None] | None, str, str | None, bool, int | str | None], dict[str, Any] | None
]


async def stream_events(
    call: Call, choice: ChoiceBuilder, include_usage: bool, continuous_usage: bool
) -> AsyncIterator[str]:
    """The call's SSE: echo chunks, one chunk per choice per step that changed it, usage, then [DONE].

    `continuous_usage` (vLLM's `continuous_usage_stats`) puts the running usage in every chunk."""
    sent: dict[int, int] = {}  # choice index -> tokens already sent (for logprob deltas)
    ended: set[int] = set()  # choices whose last chunk is out: an n > 1 request's later steps still list them

    def chunk(choices: list[dict[str, Any]]) -> str:
        body = {"id": call.id, "object": call.chunk_object, "created": call.created, "model": call.model,
                "choices": choices}  # fmt: skip
        if continuous_usage:
            body["usage"] = call.usage(sum(sent.values()))
        return sse(body)

    finals: dict[int, RequestOutput] = {}
    try:
        if call.kind == "chat.completion":  # each choice's role first, in index order (the SDK's stream helper
            for index in range(len(call.prompts) * call.n):  # builds its choices as their first chunks come)
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])  # fmt: skip
        async for i, out in merged(call):
            for c in out.outputs:
                index = i * call.n + c.index
                delta = out.new_text[c.index]
                first, done = index not in sent, sent.get(index, 0)
                if index in ended or not (delta or c.finish_reason or first):
                    continue  # tokens whose text is held back keep their logprobs for the next chunk
                ids = list(c.token_ids[done:])
                lp: list[Logprobs | None] | None = list(c.logprobs[done:]) if c.logprobs is not None else None
                if first and call.echo_texts:  # completions' echo leads the choice's first chunk, once the prompt
                    if not (c.token_ids or c.finish_reason):  # is computed: its text, and its tokens' logprobs
                        continue
                    delta, ids = call.echo_texts[i] + delta, out.prompt_token_ids + ids
                    if lp is not None:
                        lp = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lp
                built = choice(index, ids, lp, delta, c.finish_reason, first, c.stop_reason)
                if built is None:
                    continue
                sent[index] = len(c.token_ids)
                if c.finish_reason:
                    ended.add(index)
                yield chunk([built])
            if out.finished:
                finals[i] = out
                call.observe(out)
        if include_usage:
            yield sse({"id": call.id, "object": call.chunk_object, "created": call.created, "model": call.model,
                       "choices": [], "usage": call.final_usage(finals),
                       "timings": timings(call.finished)})  # fmt: skip
        yield sse("[DONE]")
    except Exception as e:  # the request failed in the engine, or the engine died: say so in-band, then end
        yield sse(error_body(500, f"generation failed: {e}"))
        yield sse("[DONE]")

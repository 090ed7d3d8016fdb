"""`POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's request and response shapes, streaming
(SSE) or not. Each prompt becomes one engine request; choices are numbered prompt-major (prompt i, sample j
-> index i * n + j), as OpenAI and vLLM do."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from tokenmill.outputs import Logprobs, RequestOutput
from tokenmill.sampling_params import MAX_LOGPROBS
from tokenmill.server.errors import APIError, bad_value, error_body
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncEngine, RequestStream
    from tokenmill.server.app import ServerState
    from tokenmill.tokenizer import Tokenizer


@dataclass
class _Call:
    """One HTTP call's engine requests and what to echo back."""

    kind: str  # "text_completion" | "chat.completion"
    id: str
    model: str
    prompts: list[list[int]]
    streams: list[RequestStream]
    n: int
    echo_texts: list[str]
    created: int


def _token_str(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(
    tok: Tokenizer, token_ids: list[int], entries: list[Logprobs | None], offset: int
) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = _token_str(tok, tid)
        tokens.append(text)
        values.append(entry[tid] if entry else None)
        tops.append({_token_str(tok, t): lp for t, lp in entry.items()} if entry else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tok: Tokenizer, token_ids: list[int], entries: list[Logprobs], top: int) -> dict[str, Any]:
    def item(t: int, lp: float) -> dict[str, Any]:
        s = _token_str(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for tid, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in ranked]})
    return {"content": content}


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    authorize = app.state.authorize

    def start(kind: str, model: str | None, prompts: list[list[int]], params: Any, priority: int) -> _Call:
        engine = state.ready_engine()
        state.check_model(model)
        state.admit(len(prompts) * params.n)
        for ids in prompts:  # validate every prompt before any starts
            try:
                engine.core.validate(ids, params)
            except ValueError as e:
                raise bad_value(e) from None
        call_id = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
        streams = [engine.add_request(ids, params, f"{call_id}-{i}", priority) for i, ids in enumerate(prompts)]
        return _Call(kind, call_id, state.config.served_model_name, prompts, streams, params.n, [], int(time.time()))

    async def merged(call: _Call) -> AsyncIterator[tuple[int, RequestOutput]]:
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

    def observe(out: RequestOutput) -> None:
        if out.finished and out.metrics is not None and state.metrics is not None:
            state.metrics.observe_finished(out.metrics, [c.finish_reason for c in out.outputs])

    def usage(call: _Call, finals: dict[int, RequestOutput]) -> dict[str, int]:
        prompt = sum(len(p) for p in call.prompts)
        completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def run_to_end(call: _Call, raw: Request) -> dict[int, RequestOutput]:
        """Collect the final outputs; if the client goes away first, abort everything (within one step)."""
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            async for i, out in merged(call):
                if out.finished:
                    finals[i] = out
                    observe(out)

        task = asyncio.create_task(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await raw.is_disconnected():
                task.cancel()  # merged() closes the streams, which aborts the requests
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client disconnected")
        task.result()
        return finals

    def stream_response(call: _Call, choice: Any, options: StreamOptions | None) -> StreamingResponse:
        """SSE for a call; `choice(index, toks, text, finish, first)` builds one choice of a chunk."""
        include_usage = options is not None and options.include_usage

        def chunk(index: int, toks: Any, text: str, finish: str | None, first: bool) -> dict[str, Any]:
            return {"id": call.id, "object": _chunk_object(call), "created": call.created, "model": call.model,
                    "choices": [choice(index, toks, text, finish, first)]}  # fmt: skip

        async def events() -> AsyncIterator[str]:
            import json

            finals: dict[int, RequestOutput] = {}
            sent: dict[int, int] = {}  # choice index -> tokens already sent (for logprob deltas)
            try:
                for i, text in enumerate(call.echo_texts):
                    for j in range(call.n):
                        yield "data: " + json.dumps(chunk(i * call.n + j, None, text, None, first=True)) + "\n\n"
                async for i, out in merged(call):
                    for c in out.outputs:
                        index = i * call.n + c.index
                        first = index not in sent
                        lp = (c.logprobs or [])[sent.get(index, 0) :] if c.logprobs is not None else None
                        ids = c.token_ids[sent.get(index, 0) :]
                        sent[index] = len(c.token_ids)
                        delta = out.new_text[c.index]
                        if delta or c.finish_reason or first:
                            payload = chunk(index, (ids, lp), delta, c.finish_reason, first=first)
                            yield "data: " + json.dumps(payload) + "\n\n"
                    if out.finished:
                        finals[i] = out
                        observe(out)
                if include_usage:
                    tail = {"id": call.id, "object": _chunk_object(call), "created": call.created,
                            "model": call.model, "choices": [], "usage": usage(call, finals)}  # fmt: skip
                    yield "data: " + json.dumps(tail) + "\n\n"
                yield "data: [DONE]\n\n"
            except Exception as e:  # the engine died mid-stream: say so in-band, then end the stream
                yield "data: " + json.dumps(error_body(500, f"generation failed: {e}")) + "\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _chunk_object(call: _Call) -> str:
        return "text_completion" if call.kind == "text_completion" else "chat.completion.chunk"

    # -- /v1/completions --------------------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=[Depends(authorize)], response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        engine = state.ready_engine()
        tok = engine.tokenizer
        assert tok is not None
        prompts = _normalize_prompt(body.prompt, tok)
        want_lp = body.logprobs
        try:
            params = body.sampling_params(
                _defaults(engine), body.max_tokens, want_lp, want_lp if (body.echo and want_lp is not None) else None
            )
        except ValueError as e:
            raise bad_value(e) from None
        call = start("text_completion", body.model, prompts, params, body.priority)
        if body.echo:
            call.echo_texts = [tok.decode(p, skip_special_tokens=False) for p in prompts]

        def choice(index: int, toks: Any, text: str, finish: str | None, first: bool) -> dict[str, Any]:
            lp = _completion_logprobs(tok, toks[0], toks[1], 0) if toks is not None and toks[1] is not None else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            return stream_response(call, choice, body.stream_options)
        finals = await run_to_end(call, raw)
        choices = []
        for i in range(len(prompts)):
            out = finals[i]
            for c in out.outputs:
                text, lp = c.text, None
                if want_lp is not None and c.logprobs is not None:
                    ids, entries = list(c.token_ids), list[Logprobs | None](c.logprobs)
                    if body.echo and out.prompt_logprobs is not None:
                        ids, entries = out.prompt_token_ids + ids, list(out.prompt_logprobs) + entries
                    lp = _completion_logprobs(tok, ids, entries, 0)
                if body.echo:
                    text = call.echo_texts[i] + text
                choices.append({"index": i * call.n + c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason})  # fmt: skip
        return {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
                "choices": choices, "usage": usage(call, finals)}  # fmt: skip

    # -- /v1/chat/completions ---------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        engine = state.ready_engine()
        tok = engine.tokenizer
        assert tok is not None
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        top = body.top_logprobs or 0
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={top} is invalid: allowed an integer in [0, {MAX_LOGPROBS}]",
                           param="top_logprobs")  # fmt: skip
        if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
            raise APIError(400, f"max_completion_tokens={body.max_completion_tokens} is invalid: allowed an integer "
                           ">= 1", param="max_completion_tokens")  # fmt: skip
        try:
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            params = body.sampling_params(_defaults(engine), max_tokens, top if body.logprobs else None, None)
        except ValueError as e:
            raise bad_value(e) from None
        call = start("chat.completion", body.model, [prompt], params, body.priority)

        def choice(index: int, toks: Any, text: str, finish: str | None, first: bool) -> dict[str, Any]:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            lp = _chat_logprobs(tok, toks[0], toks[1], top) if toks is not None and toks[1] is not None else None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            return stream_response(call, choice, body.stream_options)
        finals = await run_to_end(call, raw)
        choices = []
        for c in finals[0].outputs:
            lp = _chat_logprobs(tok, c.token_ids, c.logprobs, top) if body.logprobs and c.logprobs else None
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                            "finish_reason": c.finish_reason})  # fmt: skip
        return {"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
                "choices": choices, "usage": usage(call, finals)}  # fmt: skip


def _defaults(engine: AsyncEngine) -> Any:
    assert engine.loaded is not None
    return engine.loaded.default_sampling_params()


def _normalize_prompt(prompt: str | list[str] | list[int] | list[list[int]], tok: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]

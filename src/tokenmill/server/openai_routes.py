"""`POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's request and response shapes, streaming
(SSE, see streaming.py) or not. Each prompt becomes one engine request.

Must not import torch.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import Logprobs
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenmill.server.errors import APIError, bad_value
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from tokenmill.server.state import ServerState, get_state, ready_engine
from tokenmill.server.streaming import Call, ChoiceBuilder, completion_tokens, run_to_end, stream_events
from tokenmill.tokenizer import Tokenizer

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]


def _start(
    state: ServerState, engine: AsyncEngine, kind: str, model: str | None, prompts: list[list[int]],
    params: SamplingParams, priority: int,
) -> Call:  # fmt: skip
    """Check the load, then start every prompt (all validated before any starts)."""
    state.admit(engine, len(prompts) * params.n)
    call_id = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
    try:
        streams = engine.add_requests(prompts, params, [f"{call_id}-{i}" for i in range(len(prompts))], priority)
    except ValueError as e:
        raise bad_value(e) from None
    return Call(kind, call_id, state.config.served_model_name, prompts, streams, params.n, int(time.time()),
                state.metrics)  # fmt: skip


def _stream(call: Call, choice: ChoiceBuilder, options: StreamOptions | None) -> StreamingResponse:
    include_usage = options is not None and options.include_usage  # a final chunk with the usage
    continuous = options is not None and options.continuous_usage_stats  # the running usage in every chunk
    return StreamingResponse(stream_events(call, choice, include_usage, continuous), media_type="text/event-stream")


# -- /v1/completions ------------------------------------------------------------------------------------------
@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, raw: Request, state: State, engine: Engine) -> Any:
    state.check_model(body.model)
    _check_sizes(state, body.n, len(body.prompt) if _is_prompt_list(body.prompt) else 1)
    tok = engine.tokenizer
    prompts = await run_in_threadpool(_normalize_prompt, body.prompt, tok)  # tokenizing can take seconds
    want_lp = body.logprobs
    try:
        params = body.sampling_params(
            engine.default_sampling_params(), body.max_tokens, want_lp,
            want_lp if (body.echo and want_lp is not None) else None,
        )  # fmt: skip
    except ValueError as e:
        raise bad_value(e) from None
    call = _start(state, engine, "text_completion", body.model, prompts, params, body.priority)
    if body.echo:
        call.echo_texts = await run_in_threadpool(lambda: [tok.decode(p, skip_special_tokens=False) for p in prompts])

    def choice(
        index: int, ids: list[int], lp: list[Logprobs] | None, text: str, finish: str | None, first: bool
    ) -> dict[str, Any]:
        logprobs = _completion_logprobs(tok, ids, list(lp)) if lp is not None else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    if body.stream:
        return _stream(call, choice, body.stream_options)
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
                lp = _completion_logprobs(tok, ids, entries)
            if body.echo:
                text = call.echo_texts[i] + text
            choices.append({"index": i * call.n + c.index, "text": text, "logprobs": lp,
                            "finish_reason": c.finish_reason})  # fmt: skip
    return {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": call.usage(completion_tokens(finals))}  # fmt: skip


# -- /v1/chat/completions -------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, raw: Request, state: State, engine: Engine) -> Any:
    state.check_model(body.model)
    _check_sizes(state, body.n, 1)
    tok = engine.tokenizer
    messages = [m.as_template_dict() for m in body.messages]
    try:  # rendering and tokenizing off the event loop: a long conversation must not stall other clients
        prompt = await run_in_threadpool(tok.apply_chat_template, messages, body.add_generation_prompt)
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
        params = body.sampling_params(
            engine.default_sampling_params(), max_tokens, top if body.logprobs else None, None
        )
    except ValueError as e:
        raise bad_value(e) from None
    call = _start(state, engine, "chat.completion", body.model, [prompt], params, body.priority)

    def choice(
        index: int, ids: list[int], lp: list[Logprobs] | None, text: str, finish: str | None, first: bool
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        logprobs = _chat_logprobs(tok, ids, lp, top) if lp is not None else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    if body.stream:
        return _stream(call, choice, body.stream_options)
    finals = await run_to_end(call, raw)
    choices = []
    for c in finals[0].outputs:
        lp = _chat_logprobs(tok, c.token_ids, c.logprobs, top) if body.logprobs and c.logprobs else None
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                        "finish_reason": c.finish_reason})  # fmt: skip
    return {"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": call.usage(completion_tokens(finals))}  # fmt: skip


# -- helpers --------------------------------------------------------------------------------------------------
def _check_sizes(state: ServerState, n: int, num_prompts: int) -> None:
    """The per-request caps, checked before any tokenizing: a request may not ask for unbounded work."""
    cfg = state.config
    if n > cfg.max_n:
        raise APIError(400, f"n={n} is invalid: allowed an integer in [1, {cfg.max_n}] (--max-n)", param="n")
    if num_prompts > cfg.max_prompts:
        raise APIError(400, f"prompt holds {num_prompts} prompts: allowed at most {cfg.max_prompts} (--max-prompts)",
                       param="prompt")  # fmt: skip


def _is_prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> bool:
    """A list of prompts (strings or token-id lists), not one prompt given as token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


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


def _token_str(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tok: Tokenizer, token_ids: list[int], entries: list[Logprobs | None]) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
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

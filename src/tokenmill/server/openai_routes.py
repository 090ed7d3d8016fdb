"""`POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's request and response shapes, streaming
(SSE, see streaming.py) or not. Each prompt becomes one engine request.

Must not import torch.
"""

from __future__ import annotations

from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import Logprobs, RequestOutput
from tokenmill.sampling_params import MAX_LOGPROBS, StructuredOutputsParams
from tokenmill.server import reasoning, tools
from tokenmill.server.calls import check_sizes, start_call
from tokenmill.server.choice_stream import AnswerPlan, ChoiceStream, answer_plan, read_answer, with_reasoning
from tokenmill.server.errors import APIError, bad_value
from tokenmill.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions, _SamplingFields
from tokenmill.server.state import ServerState, get_state, ready_engine
from tokenmill.server.streaming import Call, ChoiceBuilder, run_to_end, stream_events, timings
from tokenmill.tokenizer import Tokenizer

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]


def _structured(body: _SamplingFields) -> tuple[str | None, StructuredOutputsParams | None]:
    """(the field, the constraint) from response_format / structured_outputs / guided_*; 400 when malformed."""
    try:
        found = body.structured()
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from None
    return found if found is not None else (None, None)


def _stream(call: Call, choice: ChoiceBuilder, options: StreamOptions | None) -> StreamingResponse:
    include_usage = options is not None and options.include_usage  # a final chunk with the usage
    continuous = options is not None and options.continuous_usage_stats  # the running usage in every chunk
    return StreamingResponse(stream_events(call, choice, include_usage, continuous), media_type="text/event-stream")


# -- /v1/completions ------------------------------------------------------------------------------------------
@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, raw: Request, state: State, engine: Engine) -> Any:
    state.check_model(body.model)
    check_sizes(state, body.n, len(body.prompt) if _is_prompt_list(body.prompt) else 1)
    tok = engine.tokenizer
    prompts = await run_in_threadpool(_normalize_prompt, body.prompt, tok)  # tokenizing can take seconds
    want_lp = body.logprobs
    field, constraint = _structured(body)
    _check_prompt_logprobs(body)
    echo_lp = want_lp if (body.echo and want_lp is not None) else None
    # echo with max_tokens 0: the prompt and its logprobs, nothing generated (lm-eval's loglikelihood requests; vLLM
    # runs them as one token it drops, and so does this)
    score_only = body.echo and body.max_tokens == 0
    if score_only and body.stream:
        raise APIError(400, "max_tokens=0 with echo (the prompt scored, nothing generated) is returned whole: set "
                       "stream to false", param="stream")  # fmt: skip
    try:
        params = body.sampling_params(
            engine.default_sampling_params(), 1 if score_only else body.max_tokens, want_lp,
            max(body.prompt_logprobs, echo_lp or 0) if body.prompt_logprobs is not None else echo_lp, constraint,
        )  # fmt: skip
    except ValueError as e:
        raise bad_value(e) from None
    call = await start_call(state, engine, "text_completion", "cmpl-", prompts, params, body.priority, field,
                            body.model)  # fmt: skip
    if body.echo:
        call.echo_texts = await run_in_threadpool(lambda: [tok.decode(p, skip_special_tokens=False) for p in prompts])

    offsets: dict[int, int] = {}  # choice index -> its text_offset so far (a stream's chunks go on from it)

    def choice(
        index: int, ids: list[int], lp: list[Logprobs | None] | None, text: str, finish: str | None, first: bool,
        stop: int | str | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        if not (text or ids or finish):
            return None  # a prompt's prefill step before its first token (vLLM sends none either)
        logprobs = None
        if lp is not None and want_lp is not None:
            logprobs, offsets[index] = completion_logprobs(tok, ids, lp, want_lp, offsets.get(index, 0))
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}

    if body.stream:
        return _stream(call, choice, body.stream_options)
    finals = await run_to_end(call, raw)
    choices = []
    for i in range(len(prompts)):
        out = finals[i]
        for c in out.outputs:
            text, lp = "" if score_only else c.text, None
            if want_lp is not None and c.logprobs is not None:
                ids, entries = ([], []) if score_only else (list(c.token_ids), list[Logprobs | None](c.logprobs))
                if body.echo and out.prompt_logprobs is not None:
                    ids, entries = out.prompt_token_ids + ids, list(out.prompt_logprobs) + entries
                lp, _ = completion_logprobs(tok, ids, entries, want_lp)
            if body.echo:
                text = call.echo_texts[i] + text
            finish, stop = ("length", None) if score_only else (c.finish_reason, c.stop_reason)
            choice_body = {"index": i * call.n + c.index, "text": text, "logprobs": lp, "finish_reason": finish,
                           "stop_reason": stop}  # fmt: skip
            if body.prompt_logprobs is not None:
                choice_body["prompt_logprobs"] = prompt_logprobs(tok, out.prompt_logprobs or [], body.prompt_logprobs)
            choices.append(choice_body)
    return {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": call.usage(0) if score_only else call.final_usage(finals),
            "timings": timings(call.finished)}  # fmt: skip


# -- /v1/chat/completions -------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, raw: Request, state: State, engine: Engine) -> Any:
    state.check_model(body.model)
    check_sizes(state, body.n, 1)
    _check_prompt_logprobs(body)
    tok = engine.tokenizer
    try:
        plan = tools.chat_plan(body, state.config.tool_call_parser, tok.chat_template_text)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    field, constraint = _structured(body)
    forced = tools.constraint(plan)
    if forced is not None and constraint is not None:
        raise APIError(400, f"tool_choice={plan.mode!r} constrains the output already; drop {field}", param=field)
    field, constraint = ("tool_choice", forced) if forced is not None else (field, constraint)
    prompt = await _chat_prompt(body, plan, tok)
    answer = answer_plan(plan, reasoning.pick(state.config.reasoning_parser, tok.chat_template_text), tok, prompt)
    top = _check_chat_fields(body)
    try:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = top if body.logprobs else None
        params = body.sampling_params(
            engine.default_sampling_params(), max_tokens, logprobs, body.prompt_logprobs, constraint
        )
        params = with_reasoning(params, answer, tok, body.thinking_token_budget)
    except ValueError as e:
        raise bad_value(e) from None
    call = await start_call(state, engine, "chat.completion", "chatcmpl-", [prompt], params, body.priority, field,
                            body.model)  # fmt: skip
    if answer.reasoning is not None:
        call.reasoning_count = answer.reasoning_tokens
    streams: dict[int, ChoiceStream] = {}

    def choice(
        index: int, ids: list[int], lp: list[Logprobs | None] | None, text: str, finish: str | None, first: bool,
        stop: int | str | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        cs = streams.setdefault(index, ChoiceStream(answer))
        delta: dict[str, Any] = cs.feed(text, finish is not None)
        if not (delta or finish):
            return None  # nothing to send yet (a tag's first characters, a call's name still being written)
        if cs.calls and finish == "stop":
            finish = "tool_calls"
        logprobs = chat_logprobs(tok, ids, cast(list[Logprobs], lp), top) if lp is not None else None  # (no echo)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}

    if body.stream:
        return _stream(call, choice, body.stream_options)
    finals = await run_to_end(call, raw)
    return _chat_body(call, finals[0], answer, tok, body, top)


async def _chat_prompt(body: ChatCompletionRequest, plan: tools.ToolPlan, tok: Tokenizer) -> list[int]:
    """The conversation rendered and tokenized (off the event loop: a long one must not stall other clients), with
    the tools the plan shows and the request's `chat_template_kwargs`."""
    messages = [m.as_template_dict() for m in body.messages]
    extra = dict(body.chat_template_kwargs or {})
    taken = next((k for k in extra if k in ("messages", "add_generation_prompt", "tools")), None)
    if taken is not None:
        raise APIError(400, f"chat_template_kwargs may not set {taken!r}: give it as the request's own field",
                       param="chat_template_kwargs")  # fmt: skip
    if plan.mode != "none":
        extra["tools"] = plan.tools
    try:
        return await run_in_threadpool(tok.apply_chat_template, messages, body.add_generation_prompt, **extra)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def _chat_body(
    call: Call, final: RequestOutput, answer: AnswerPlan, tok: Tokenizer, body: ChatCompletionRequest, top: int
) -> dict[str, Any]:  # fmt: skip
    choices = []
    for c in final.outputs:
        lp = chat_logprobs(tok, c.token_ids, c.logprobs, top) if body.logprobs and c.logprobs else None
        thought, content, calls = read_answer(answer, c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if answer.reasoning is not None:
            message["reasoning_content"] = thought
        finish = c.finish_reason
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish,
                        "stop_reason": c.stop_reason})  # fmt: skip
    out = {"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
           "choices": choices, "usage": call.final_usage({0: final}),
           "timings": timings(call.finished)}  # fmt: skip
    if body.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(tok, final.prompt_logprobs or [], body.prompt_logprobs)
    return out


def _check_prompt_logprobs(body: _SamplingFields) -> None:
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is returned with whole responses only: set stream to false",
                       param="prompt_logprobs")  # fmt: skip


def _check_chat_fields(body: ChatCompletionRequest) -> int:
    """The chat-only limits; returns top_logprobs."""
    top = body.top_logprobs or 0
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if not 0 <= top <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs={top} is invalid: allowed an integer in [0, {MAX_LOGPROBS}]",
                       param="top_logprobs")  # fmt: skip
    if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
        raise APIError(400, f"max_completion_tokens={body.max_completion_tokens} is invalid: allowed an integer "
                       ">= 1", param="max_completion_tokens")  # fmt: skip
    return top


# -- helpers ---------------------------------------------------------------------------------------------------
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

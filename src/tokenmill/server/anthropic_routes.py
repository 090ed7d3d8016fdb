"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the same path as a chat
completion (the chat template, tools.py's tool plans and parsing, the same sampling fields, `calls.start_call`).
Requests are anthropic_protocol.py's models; the answer, whole or streamed, is anthropic_stream.py's; errors
take Anthropic's shape by their path (errors.body_for).

`thinking` is refused while tokenmill has no reasoning parser: a `thinking` block needs the model's reasoning
told apart from its answer, which nothing here does yet.

Must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server import tools
from tokenmill.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tokenmill.server.anthropic_stream import ABORTED, message_body, message_events
from tokenmill.server.calls import start_call
from tokenmill.server.errors import APIError, bad_value
from tokenmill.server.state import ServerState, get_state, ready_engine
from tokenmill.server.streaming import run_to_end

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]


@dataclass(frozen=True)
class Prompt:
    """A Messages request's prompt side: rendered token ids, the tool plan, and the grammar a forced tool needs."""

    token_ids: list[int]
    plan: tools.ToolPlan
    constraint: StructuredOutputsParams | None


async def _prompt(body: CountTokensRequest, state: ServerState, engine: AsyncEngine) -> Prompt:
    state.check_model(body.model)
    if body.thinking is not None and body.thinking.type != "disabled":
        raise APIError(400, f"thinking of type {body.thinking.type!r} is not supported: tokenmill has no reasoning "
                       "parser yet; leave thinking out or give {\"type\": \"disabled\"}", param="thinking")  # fmt: skip
    tok = engine.tokenizer
    choice, name = body.tool_choice_mode()
    try:
        plan = tools.plan(body.template_tools(), choice, state.config.tool_call_parser, tok.chat_template_text, name)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
    try:
        messages = body.template_messages()
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    extra = {"tools": plan.tools} if plan.mode != "none" else {}
    try:  # rendering and tokenizing off the event loop: a long conversation must not stall other clients
        token_ids = await run_in_threadpool(tok.apply_chat_template, messages, True, **extra)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return Prompt(token_ids, plan, tools.constraint(plan, parallel))


@router.post("/v1/messages", response_model=None)
async def messages(body: MessagesRequest, raw: Request, state: State, engine: Engine) -> Any:
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens={body.max_tokens} is invalid: allowed an integer >= 1", param="max_tokens")
    prompt = await _prompt(body, state, engine)
    try:
        params = body.sampling_fields().sampling_params(
            engine.default_sampling_params(), body.max_tokens, None, None, prompt.constraint
        )
    except ValueError as e:
        raise bad_value(e) from None
    field = "tool_choice" if prompt.constraint is not None else None
    call = await start_call(state, engine, "message", "msg_", [prompt.token_ids], params, 0, field)
    if body.stream:
        return StreamingResponse(message_events(call, prompt.plan), media_type="text/event-stream")
    out = (await run_to_end(call, raw))[0].outputs[0]
    if out.finish_reason == "abort":
        raise APIError(503, ABORTED, headers={"Retry-After": "5"})
    return message_body(call, prompt.plan, out)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State, engine: Engine) -> dict[str, int]:
    """The prompt's tokens as /v1/messages would render them (tools included)."""
    prompt = await _prompt(body, state, engine)
    return {"input_tokens": len(prompt.token_ids)}

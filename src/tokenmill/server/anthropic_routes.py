"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the same path as a chat
completion (the chat template, tools.py's tool plans and parsing, the same sampling fields, `calls.start_call`).
Requests are anthropic_protocol.py's models; the answer, whole or streamed, is anthropic_stream.py's; errors
take Anthropic's shape by their path (errors.body_for).

With a reasoning parser on (`--reasoning-parser`), the model's thinking comes back as `thinking` blocks;
`thinking: {"type": "enabled", "budget_tokens": N}` is the thinking budget, and `{"type": "disabled"}` reaches the
chat template as `enable_thinking: false`.

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
from tokenmill.server import reasoning, tools
from tokenmill.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tokenmill.server.anthropic_stream import ABORTED, message_body, message_events
from tokenmill.server.calls import start_call
from tokenmill.server.choice_stream import AnswerPlan, answer_plan, with_reasoning
from tokenmill.server.errors import APIError, bad_value
from tokenmill.server.state import ServerState, get_state, ready_engine
from tokenmill.server.streaming import run_to_end

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]


@dataclass(frozen=True)
class Prompt:
    """A Messages request's prompt side: rendered token ids, how the answer is read (tools, reasoning), and the
    grammar a forced tool needs."""

    token_ids: list[int]
    answer: AnswerPlan
    constraint: StructuredOutputsParams | None


async def _prompt(body: CountTokensRequest, state: ServerState, engine: AsyncEngine) -> Prompt:
    state.check_model(body.model)
    tok = engine.tokenizer
    parser = reasoning.pick(state.config.reasoning_parser, tok.chat_template_text)
    if body.thinking is not None and body.thinking.type != "disabled" and parser is None:
        raise APIError(400, f"thinking of type {body.thinking.type!r} needs a reasoning parser, and this server has "
                       "none for its model (--reasoning-parser)", param="thinking")  # fmt: skip
    choice, name = body.tool_choice_mode()
    parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
    try:
        plan = tools.plan(body.template_tools(), choice, state.config.tool_call_parser, tok.chat_template_text, name,
                          parallel)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    try:
        messages = body.template_messages()
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    extra: dict[str, Any] = body.thinking.template_kwargs() if body.thinking is not None else {}
    if plan.mode != "none":
        extra["tools"] = plan.tools
    try:  # rendering and tokenizing off the event loop: a long conversation must not stall other clients
        token_ids = await run_in_threadpool(tok.apply_chat_template, messages, True, **extra)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return Prompt(token_ids, answer_plan(plan, parser, tok, token_ids), tools.constraint(plan))


@router.post("/v1/messages", response_model=None)
async def messages(body: MessagesRequest, raw: Request, state: State, engine: Engine) -> Any:
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens={body.max_tokens} is invalid: allowed an integer >= 1", param="max_tokens")
    prompt = await _prompt(body, state, engine)
    try:
        params = body.sampling_fields().sampling_params(
            engine.default_sampling_params(), body.max_tokens, None, None, prompt.constraint
        )
        budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
        params = with_reasoning(params, prompt.answer, engine.tokenizer, budget)
    except ValueError as e:
        raise bad_value(e) from None
    field = "tool_choice" if prompt.constraint is not None else None
    call = await start_call(state, engine, "message", "msg_", [prompt.token_ids], params, 0, field, body.model)
    if body.stream:
        return StreamingResponse(message_events(call, prompt.answer), media_type="text/event-stream")
    out = (await run_to_end(call, raw))[0].outputs[0]
    if out.finish_reason == "abort":
        raise APIError(503, ABORTED, headers={"Retry-After": "5"})
    return message_body(call, prompt.answer, out)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State, engine: Engine) -> dict[str, int]:
    """The prompt's tokens as /v1/messages would render them (tools included)."""
    prompt = await _prompt(body, state, engine)
    return {"input_tokens": len(prompt.token_ids)}

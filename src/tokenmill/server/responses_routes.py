"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), and over the store (responses_store.py)
`GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel`.

A response runs the same path as a chat completion: the conversation (the stored one that `previous_response_id`
ended, then this input) through the chat template, tools.py's plans and parsing, the reasoning parser, the same
sampling fields and `calls.start_call`. Requests are responses_protocol.py's models; the answer is
responses_output.py's, streamed by responses_stream.py; errors take OpenAI's shape.

With a reasoning parser (`--reasoning-parser`), the model's thinking comes back as a `reasoning` item,
`reasoning.effort` reaches the chat template (responses_protocol.ResponsesRequest.template_kwargs) and
`thinking_token_budget` is the thinking budget, as in a chat completion. Without one, reasoning items in the input
and efforts other than none/minimal are a 400.

`background: true` answers at once and runs on in the server (responses_background.py); cancel stops such a run
(the response is `cancelled`), returns a finished one as it is, answers 400 for a response not made in the
background, as OpenAI does, and 404 for an unknown one.

Must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server import reasoning, tools
from tokenmill.server.calls import start_call
from tokenmill.server.choice_stream import AnswerPlan, answer_plan, with_reasoning
from tokenmill.server.errors import APIError, bad_value
from tokenmill.server.responses_background import BackgroundRun
from tokenmill.server.responses_output import ABORTED, ResponseHead, response_body
from tokenmill.server.responses_protocol import THINKING_OFF, ResponsesRequest, template_messages
from tokenmill.server.responses_store import StoredResponse
from tokenmill.server.responses_stream import response_events
from tokenmill.server.state import ServerState, get_state, ready_engine
from tokenmill.server.streaming import Call, run_to_end

router = APIRouter()
State = Annotated[ServerState, Depends(get_state)]
Engine = Annotated[AsyncEngine, Depends(ready_engine)]
# as OpenAI's: an id that cannot be a response's is a 400, one that could be but is not stored a 404
ResponseId = Annotated[str, Path(pattern=r"^resp_[A-Za-z0-9_-]{1,100}$")]
NO_PARSER = ("this server runs without a reasoning parser for its model (--reasoning-parser; auto finds none in "
             "its chat template)")  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    """A response's prompt side: this request's input items, the rendered token ids, how the answer is read (tools,
    reasoning), and the grammar the output must follow (a forced tool's, or text.format's) with the field it came
    from."""

    input_items: list[dict[str, Any]]
    token_ids: list[int]
    answer: AnswerPlan
    constraint: StructuredOutputsParams | None
    field: str | None


async def _prompt(body: ResponsesRequest, state: ServerState, engine: AsyncEngine) -> Prompt:
    tok = engine.tokenizer
    parser = reasoning.pick(state.config.reasoning_parser, tok.chat_template_text)
    choice, name = body.tool_choice_mode()
    try:
        plan = tools.plan(body.template_tools(), choice, state.config.tool_call_parser, tok.chat_template_text, name,
                          body.parallel_tool_calls)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    forced, formatted = tools.constraint(plan), body.structured()
    if forced is not None and formatted is not None:
        raise APIError(400, f"tool_choice={plan.mode!r} constrains the output already; drop text.format",
                       param="text.format")  # fmt: skip
    items = body.input_items()
    if parser is None:
        _check_without_parser(body, items)
    conversation = state.responses.conversation(body.previous_response_id) + items
    if not conversation:
        raise APIError(400, "input is empty: give a string or at least one item", param="input")
    try:
        messages = template_messages(body.instructions, conversation)
    except ValueError as e:
        raise APIError(400, str(e), param="input") from None
    extra = {**body.template_kwargs(), **({"tools": plan.tools} if plan.mode != "none" else {})}
    try:  # rendering and tokenizing off the event loop: a long conversation must not stall other clients
        token_ids = await run_in_threadpool(tok.apply_chat_template, messages, True, **extra)
    except ValueError as e:
        raise APIError(400, str(e), param="input") from None
    field = "tool_choice" if forced is not None else "text.format" if formatted is not None else None
    return Prompt(items, token_ids, answer_plan(plan, parser, tok, token_ids), forced or formatted, field)


def _check_without_parser(body: ResponsesRequest, items: list[dict[str, Any]]) -> None:
    if any(item["type"] == "reasoning" for item in items):
        raise APIError(400, f"input items of type 'reasoning' need a reasoning parser: {NO_PARSER}", param="input")
    if body.effort not in (None, *THINKING_OFF):
        raise APIError(400, f"reasoning.effort={body.effort!r} needs a reasoning parser: {NO_PARSER}; allowed "
                       "here: none and minimal", param="reasoning.effort")  # fmt: skip


def _params(body: ResponsesRequest, engine: AsyncEngine, prompt: Prompt) -> SamplingParams:
    try:
        params = body.sampling_fields().sampling_params(
            engine.default_sampling_params(), body.max_output_tokens, None, None, prompt.constraint
        )
        return with_reasoning(params, prompt.answer, engine.tokenizer, body.thinking_token_budget)
    except ValueError as e:
        raise bad_value(e) from None


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, raw: Request, state: State, engine: Engine) -> Any:
    state.check_model(body.model)
    if body.background and state.responses.capacity == 0:
        raise APIError(400, "background=true needs the response store, and this server keeps none "
                       "(--responses-store-size 0)", param="background")  # fmt: skip
    prompt = await _prompt(body, state, engine)
    params = _params(body, engine, prompt)
    call = await start_call(state, engine, "response", "resp_", [prompt.token_ids], params, 0, prompt.field,
                            body.model)  # fmt: skip
    head = ResponseHead.of(call.id, call.model, body, params.temperature, params.top_p)
    if body.background:
        return _background(body, state, prompt, call, head)

    def store(response: dict[str, Any]) -> None:
        if body.store and response["status"] != "failed":
            state.responses.put(StoredResponse(response, prompt.input_items, body.previous_response_id))

    if body.stream:
        return StreamingResponse(response_events(call, prompt.answer, head, store), media_type="text/event-stream")
    final = (await run_to_end(call, raw))[0]
    if final.outputs[0].finish_reason == "abort":
        raise APIError(503, ABORTED, headers={"Retry-After": "5"})
    response = response_body(head, prompt.answer, len(prompt.token_ids), final)
    store(response)
    return response


def _background(body: ResponsesRequest, state: ServerState, prompt: Prompt, call: Call, head: ResponseHead) -> Any:
    """Store the response, queued, with its run; answer it (or stream its events) while the run goes on."""
    run = BackgroundRun(streamed=body.stream)
    queued = head.body("queued", [], None)
    state.responses.put(StoredResponse(queued, prompt.input_items, body.previous_response_id, run))
    run.start(call, prompt.answer, head, lambda response: state.responses.update(head.id, response))
    if body.stream:
        return StreamingResponse(run.follow(-1), media_type="text/event-stream")
    return queued


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(
    response_id: ResponseId, state: State, stream: bool = False, starting_after: Annotated[int, Query(ge=-1)] = -1
) -> Any:
    """The response as it is now; `stream=true`: a streamed background response's events after `starting_after`,
    to its end."""
    stored = state.responses.get(response_id)
    if not stream:
        return stored.body
    if stored.run is None or stored.run.events is None:
        raise APIError(400, "stream=true replays the events of a response created with background=true and "
                       "stream=true; this one was not: retrieve it whole", param="stream")  # fmt: skip
    return StreamingResponse(stored.run.follow(starting_after), media_type="text/event-stream")


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: ResponseId, state: State) -> dict[str, Any]:
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: ResponseId, state: State) -> dict[str, Any]:
    """Stop a background response that is still running (it is then `cancelled`); a finished one is returned as it
    is, as OpenAI does."""
    stored = state.responses.get(response_id)
    if stored.run is None:
        raise APIError(400, "Only responses created with background=true can be cancelled; this one was not",
                       param="response_id")  # fmt: skip
    if not stored.run.done:
        stored.run.stop()  # the engine request is aborted; the run writes nothing more
        state.responses.update(response_id, {**stored.body, "status": "cancelled"})
    return state.responses.get(response_id).body


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: ResponseId,
    state: State,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """This response's own input items (not those of the responses it continued), newest first by default."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit={limit} is invalid: allowed an integer in [1, 100]", param="limit")
    items = state.responses.get(response_id).input_items
    items = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(400, f"after={after!r} is not an input item of this response", param="after")
        items = items[at + 1 :]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip

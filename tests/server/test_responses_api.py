"""OpenAI's Responses API (`/v1/responses` and its store) driven by the official `openai` SDK's `responses.create`,
`responses.stream` and `responses.parse`, against a real `tokenmill serve` subprocess. What it answers is checked
against the same conversation through `/v1/chat/completions` on the same server: both render one chat template and
sample one way. Tool calls: forced ones (`tool_choice` named / `required`) on the module's tiny model, and ones the
model writes itself on test_structured_serve.py's Hermes-trained model."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import Server, assert_openai_error, sse_events
from tests.server.test_structured_serve import ASK, PARIS, ROME, TOOLS, WEATHER, Person, hermes_server  # noqa: F401 (a fixture)

SERVER_FLAGS = ("--responses-store-size", "4", "--max-body-mb", "1")
SYSTEM = "You are terse."
USER = "Hello world!"
# the Responses API's flat function tools
FLAT_TOOLS: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
WEATHER_CHOICE: Any = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)


def _create(client: openai.OpenAI, server: Server, **kwargs: Any) -> Any:
    kwargs = {"instructions": SYSTEM, "input": USER, "max_output_tokens": 12, "temperature": 0, **kwargs}
    return client.responses.create(model=server.model, **kwargs)


def _chat(client: openai.OpenAI, server: Server, messages: list[Any], max_tokens: int) -> Any:
    return client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                          temperature=0)  # fmt: skip


def _usage(r: Any) -> tuple[int, int, int]:
    return r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens


def test_greedy_text_and_usage_equal_chat_completions(client: openai.OpenAI, server: Server) -> None:
    chat = _chat(client, server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 12)
    assert chat.choices[0].finish_reason == "length"  # this prompt runs to its budget: the test means something
    r = _create(client, server)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model
    assert [o.type for o in r.output] == ["message"] and r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details and r.incomplete_details.reason == "max_output_tokens"
    assert _usage(r) == (chat.usage.prompt_tokens, 12, chat.usage.prompt_tokens + 12)
    assert (r.instructions, r.max_output_tokens, r.temperature) == (SYSTEM, 12, 0)
    # the conversation as items renders the prompt of the chat completions' text parts: joined by newlines
    items: Any = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
                  {"role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                               {"type": "input_text", "text": "world!"}]}]  # fmt: skip
    same = _create(client, server, instructions=openai.omit, input=items)
    parts: Any = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world!"}]
    split = _chat(client, server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}], 12)
    want = split.usage
    assert (same.output_text, _usage(same)) == (
        split.choices[0].message.content,
        (want.prompt_tokens, want.completion_tokens, want.total_tokens),
    )


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, server: Server) -> None:
    first = _create(client, server, max_output_tokens=4)
    second = _create(client, server, previous_response_id=first.id, input="And then?", instructions=openai.omit,
                     max_output_tokens=6)  # fmt: skip
    # instructions are not carried over: the chat has no system message
    messages: list[Any] = [{"role": "user", "content": USER}, {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "And then?"}]  # fmt: skip
    chat = _chat(client, server, messages, 6)
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_response_sends_typed_events_that_join_to_the_final_response(
    client: openai.OpenAI, server: Server
) -> None:
    want = _create(client, server)
    with client.responses.stream(model=server.model, instructions=SYSTEM, input=USER, max_output_tokens=12,
                                 temperature=0) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas), "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == want.output_text
    assert final.status == "incomplete" and _usage(final) == _usage(want) and final.id != want.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    # each SSE event names its type, as OpenAI's do
    body = {"model": server.model, "input": USER, "max_output_tokens": 3, "stream": True}
    raw = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert all(json.loads(e["data"])["type"] == e["event"] for e in sse_events(raw.text))
    # a streamed response is stored too
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_text_format_json_schema_and_parse(client: openai.OpenAI, server: Server) -> None:
    for temperature in (0.0, 1.0):
        r = client.responses.parse(model=server.model, input=ASK, text_format=Person, max_output_tokens=200,
                                   temperature=temperature)  # fmt: skip
        assert isinstance(r.output_parsed, Person) and r.status == "completed" and r.incomplete_details is None
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
              "additionalProperties": False}  # fmt: skip
    fmt: Any = {"format": {"type": "json_schema", "name": "k", "schema": schema, "strict": True}}
    with client.responses.stream(model=server.model, input=ASK, text=fmt, max_output_tokens=60) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), schema)
    assert final.text and final.text.format and final.text.format.type == "json_schema"
    anything = client.responses.create(model=server.model, input=ASK, text={"format": {"type": "json_object"}},
                                       max_output_tokens=60, temperature=0)  # fmt: skip
    assert anything.status == "completed" and isinstance(json.loads(anything.output_text), dict)


def test_a_forced_function_call_round_trip(client: openai.OpenAI, server: Server) -> None:
    ask: Any = {"model": server.model, "input": ASK, "tools": FLAT_TOOLS, "max_output_tokens": 60}
    strict: Any = [{**FLAT_TOOLS[0], "strict": True}]
    r = client.responses.parse(**{**ask, "tools": strict}, tool_choice=WEATHER_CHOICE, temperature=1.0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert call.parsed_arguments == json.loads(call.arguments)
    jsonschema.validate(call.parsed_arguments, WEATHER)
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}
    kept = client.responses.create(model=server.model, previous_response_id=r.id, input=[result], tools=FLAT_TOOLS,
                                   max_output_tokens=5, temperature=0)  # fmt: skip
    assert [o.type for o in kept.output] == ["message"] and kept.status == "incomplete"
    # the same conversation sent back by hand, the SDK's own output item in it
    by_hand = client.responses.create(model=server.model, input=[*ASK, call, result], tools=FLAT_TOOLS, store=False,
                                      max_output_tokens=5, temperature=0)  # fmt: skip
    assert (by_hand.output_text, _usage(by_hand)) == (kept.output_text, _usage(kept))
    required = client.responses.create(**{**ask, "max_output_tokens": 120}, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0)  # fmt: skip
    assert [o.type for o in required.output] == ["function_call"]
    schema = next(t["parameters"] for t in FLAT_TOOLS if t["name"] == required.output[0].name)
    jsonschema.validate(json.loads(required.output[0].arguments), schema)


def test_a_streamed_forced_function_call_sends_its_arguments_as_they_are_generated(
    client: openai.OpenAI, server: Server
) -> None:
    kw: Any = dict(model=server.model, input=ASK, tools=FLAT_TOOLS, tool_choice=WEATHER_CHOICE, max_output_tokens=60,
                   temperature=0)  # fmt: skip
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 2 and len(done) == 1 and done[0].arguments == "".join(pieces)
    whole = client.responses.create(**kw)
    assert final.output[0].type == "function_call" and final.output[0].arguments == whole.output[0].arguments
    jsonschema.validate(json.loads(final.output[0].arguments), WEATHER)


def test_function_calls_the_model_writes_itself_are_parsed(hermes_server: Server) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=f"{hermes_server.url}/v1", api_key="x", timeout=120, max_retries=0)
    kw: Any = dict(model=hermes_server.model, input=ASK, tools=FLAT_TOOLS, max_output_tokens=200, temperature=0)
    for parallel, want in ((True, [PARIS, ROME]), (False, [PARIS])):  # parallel_tool_calls false: the first call
        r = client.responses.create(**kw, parallel_tool_calls=parallel)
        assert [o.type for o in r.output] == ["message"] + ["function_call"] * len(want), r.output
        assert r.output_text == "Let me check." and r.status == "completed" and r.parallel_tool_calls is parallel
        assert [(o.name, json.loads(o.arguments)) for o in r.output[1:]] == [("get_weather", a) for a in want]
        with client.responses.stream(**kw, parallel_tool_calls=parallel) as stream:
            final = stream.get_final_response()
        assert [o.type for o in final.output] == [o.type for o in r.output] and final.output_text == "Let me check."
        assert [o.arguments for o in final.output[1:]] == [o.arguments for o in r.output[1:]]
    none = client.responses.create(**kw, tool_choice="none")  # no tools shown: no parsing
    assert [o.type for o in none.output] == ["message"]


def test_store_retrieve_list_input_items_delete(client: openai.OpenAI, server: Server) -> None:
    r = _create(client, server, max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, _usage(got), got.metadata) == (r.id, r.output_text, _usage(r), {"k": "v"})
    items = client.responses.input_items.list(r.id).data
    assert len(items) == 1 and items[0].type == "message" and items[0].role == "user"
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == USER
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(r.id)
    turns: Any = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    many = _create(client, server, input=turns, max_output_tokens=1)
    newest = client.responses.input_items.list(many.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["turn 4", "turn 3"] and newest.has_more
    rest = client.responses.input_items.list(many.id, after=newest.data[-1].id, limit=100)
    assert [i.content[0].text for i in rest.data] == ["turn 2", "turn 1", "turn 0"] and not rest.has_more
    paged = client.responses.input_items.list(many.id, order="asc", limit=2)  # the SDK follows the cursor
    assert [i.content[0].text for i in paged] == [t["content"] for t in turns]
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.cancel(r.id),
                 lambda: _create(client, server, previous_response_id=r.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError, match=r.id):
            call()
    unstored = _create(client, server, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_drops_the_least_recently_used_response(client: openai.OpenAI, server: Server) -> None:
    ids = [_create(client, server, max_output_tokens=1).id for _ in range(4)]  # the store holds 4 (SERVER_FLAGS)
    client.responses.retrieve(ids[0])  # now the most recently used
    ids.append(_create(client, server, max_output_tokens=1).id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:]):
        assert client.responses.retrieve(kept).id == kept


def _bad_cases(model: str, stored: str) -> list[tuple[dict[str, Any], int, tuple[str, ...]]]:
    ok: dict[str, Any] = {"model": model, "input": USER, "max_output_tokens": 4}
    items = lambda *xs: {**ok, "input": list(xs)}  # noqa: E731
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    orphan = {"type": "function_call_output", "call_id": "call_nope", "output": "12 C"}
    return [
        (items({"type": "computer_call_output", "call_id": "c", "output": {}}), 400,
         ("unknown input item type 'computer_call_output'",)),
        (items({"role": "user", "content": [image]}), 400, ("'input_image'", "text only")),
        (items({"type": "reasoning", "summary": []}), 400, ("'reasoning'", "--reasoning-parser")),
        (items({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}), 400, ("encrypted_content",)),
        (items(orphan), 400, ("call_nope",)),
        ({**ok, "previous_response_id": stored, "input": [orphan]}, 400, ("call_nope",)),
        ({**ok, "previous_response_id": "resp_gone"}, 404, ("resp_gone", "previous_response_id")),
        ({**ok, "tools": [{"type": "web_search"}]}, 400, ("'web_search'", "function tools only")),
        ({**ok, "tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, 400, ("'file_search'",)),
        ({**ok, "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, ("'nope'",)),
        ({**ok, "tools": FLAT_TOOLS * 2}, 400, ("tool names must be unique", "'get_weather'")),
        ({**ok, "tool_choice": {"type": "file_search"}}, 400, ("tool_choice",)),
        ({**ok, "tool_choice": "required"}, 400, ("needs tools",)),
        ({**ok, "tools": FLAT_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 400,
         ("constrains the output already",)),
        ({**ok, "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, ("schema",)),
        ({**ok, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}}, 400,
         ("text.format",)),
        ({**ok, "background": True, "store": False}, 400, ("background", "store=true")),
        ({**ok, "reasoning": {"effort": "high"}}, 400, ("reasoning.effort", "--reasoning-parser")),
        ({**ok, "reasoning": {"effort": "huge"}}, 400, ("effort",)),
        ({**ok, "include": ["file_search_call.results"]}, 400, ("file_search_call.results",)),
        ({**ok, "truncation": "auto"}, 400, ("truncation",)),
        ({**ok, "top_logprobs": 2}, 400, ("unsupported parameter: top_logprobs",)),
        ({**ok, "max_output_tokens": 0}, 400, ("max_output_tokens=0",)),
        ({**ok, "max_output_tokens": 10**6}, 400, ("maximum context length", "1000000")),
        ({**ok, "temperature": -1}, 400, ("temperature",)),
        ({**ok, "input": []}, 400, ("input",)),
        ({**ok, "input": 5}, 400, ("input",)),
        ({**ok, "model": "gpt-nope"}, 404, ("gpt-nope",)),
        ({**ok, "input": "x" * (2 * 2**20)}, 413, ("request body too large",)),
    ]  # fmt: skip


def test_null_is_a_parameter_left_out(client: openai.OpenAI, server: Server) -> None:
    """The SDK types these optional and sends null for a None it is passed: null means the default, for fields
    tokenmill implements (store, stream, background, parallel_tool_calls) and for those it lacks (service_tier);
    a value for one it lacks stays a 400."""
    want = _create(client, server)
    nulls: Any = dict(store=None, stream=None, background=None, parallel_tool_calls=None, service_tier=None,
                      top_logprobs=None, max_tool_calls=None, prompt=None, conversation=None)  # fmt: skip
    r = _create(client, server, **nulls)
    assert r.output_text == want.output_text and (r.store, r.background, r.parallel_tool_calls) == (True, False, True)
    assert client.responses.retrieve(r.id).output_text == want.output_text  # stored, as by default
    with pytest.raises(openai.BadRequestError, match="service_tier"):
        _create(client, server, service_tier="flex")


def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(client: openai.OpenAI, server: Server) -> None:
    stored = _create(client, server, max_output_tokens=1).id
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, status, mentions in _bad_cases(server.model, stored):
            error = assert_openai_error(http.post("/v1/responses", json=body), status, *mentions)
            assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}.get(status, error["type"])
        raw = {"content-type": "application/json"}
        assert_openai_error(http.post("/v1/responses", content=b'{"model": ', headers=raw), 400, "malformed JSON")
        assert_openai_error(http.get("/v1/responses/resp_nope"), 404, "resp_nope")
        assert_openai_error(http.get(f"/v1/responses/{stored}", params={"stream": "true"}), 400, "background")
        assert_openai_error(http.delete("/v1/responses/chatcmpl-1"), 400, "response_id")
        assert_openai_error(http.get(f"/v1/responses/{stored}/input_items", params={"limit": 0}), 400, "limit")
        assert http.get("/health").status_code == 200
    assert _create(client, server, max_output_tokens=3).usage.output_tokens == 3

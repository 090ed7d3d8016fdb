"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the official `anthropic` SDK,
sync, async and streaming, against a real `tokenmill serve` subprocess. What it answers is checked against the
same conversation through `/v1/chat/completions` on the same server: both render one chat template and sample
one way. Tool calls: forced ones (`tool_choice` `tool` / `any`) on the module's tiny model, and ones the model
writes itself on test_structured_serve.py's Hermes-trained model."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import Server, sse_events
from tests.server.test_structured_serve import ASK, PARIS, ROME, TOOLS, WEATHER, hermes_server  # noqa: F401 (a fixture)

SYSTEM = "You are terse."
USER = "Hello world!"
MESSAGES: list[Any] = [{"role": "user", "content": USER}]
ANTHROPIC_TOOLS: list[Any] = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
     **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
    for t in TOOLS
]  # fmt: skip
WEATHER_TOOL: Any = {"type": "tool", "name": "get_weather"}
# this SDK's messages.create has no sampling arguments any more; the API (and tokenmill) still takes them
GREEDY, HOT = {"temperature": 0.0}, {"temperature": 1.0}


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)


def _create(client: anthropic.Anthropic, server: Server, **kwargs: Any) -> Any:
    kwargs = {"messages": MESSAGES, "system": SYSTEM, "max_tokens": 12, "extra_body": GREEDY, **kwargs}
    return client.messages.create(model=server.model, **kwargs)


def _chat(oai: openai.OpenAI, server: Server, max_tokens: int, **kwargs: Any) -> Any:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, *MESSAGES]
    return oai.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens, temperature=0,
                                       **kwargs)  # fmt: skip


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_greedy_text_and_usage_equal_chat_completions(
    client: anthropic.Anthropic, oai: openai.OpenAI, server: Server
) -> None:
    chat = _chat(oai, server, 12)
    assert chat.choices[0].finish_reason == "length"  # this prompt runs to its budget: the test means something
    m = _create(client, server)
    assert m.type == "message" and m.role == "assistant" and m.model == server.model and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and _text(m) == chat.choices[0].message.content
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    # the conversation as text blocks renders the prompt of the chat completions' text parts: joined by newlines
    parts: Any = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world!"}]
    blocks = _create(client, server, system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
                     messages=[{"role": "user", "content": parts}])  # fmt: skip
    split = oai.chat.completions.create(model=server.model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}])  # fmt: skip
    assert (_text(blocks), blocks.usage.input_tokens) == (split.choices[0].message.content, split.usage.prompt_tokens)


def test_a_message_sent_back_as_the_sdk_dumps_it_continues_the_conversation(
    client: anthropic.Anthropic, server: Server
) -> None:
    """`model_dump()` of a reply's blocks writes `citations: null` (the SDK types it optional): null is the field left
    out, so the history goes back as the SDK gives it, and renders the prompt its plain dicts do."""
    first = _create(client, server)
    dumped = [b.model_dump() for b in first.content]
    assert dumped[0]["citations"] is None
    turn: Any = [*MESSAGES, {"role": "assistant", "content": dumped}, {"role": "user", "content": "And?"}]
    plain: Any = [*MESSAGES, {"role": "assistant", "content": _text(first)}, {"role": "user", "content": "And?"}]
    a, b = _create(client, server, messages=turn), _create(client, server, messages=plain)
    assert (_text(a), a.usage.input_tokens) == (_text(b), b.usage.input_tokens)


def test_stop_sequences_end_with_stop_reason_stop_sequence(client: anthropic.Anthropic, server: Server) -> None:
    full = _text(_create(client, server, max_tokens=20))
    stop = full[4:6]
    assert stop.strip() and full.find(stop) == 4, full  # a stop string the greedy text holds, first at 4
    m = _create(client, server, max_tokens=20, stop_sequences=["not-in-the-text", stop])
    assert (m.stop_reason, m.stop_sequence, _text(m)) == ("stop_sequence", stop, full[:4])


def test_async_client_and_stream_assemble_the_same_message(client: anthropic.Anthropic, server: Server) -> None:
    want = _create(client, server)

    async def main() -> tuple[Any, Any, list[str]]:
        aclient = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", timeout=60, max_retries=0)
        kw: dict[str, Any] = dict(model=server.model, messages=MESSAGES, system=SYSTEM, max_tokens=12,
                                  extra_body=GREEDY)  # fmt: skip
        whole = await aclient.messages.create(**kw)
        async with aclient.messages.stream(**kw) as stream:
            pieces = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        return whole, final, pieces

    whole, final, pieces = asyncio.run(main())
    with client.messages.stream(model=server.model, messages=MESSAGES, system=SYSTEM, max_tokens=12,
                                extra_body=GREEDY) as stream:  # fmt: skip
        sync_final = stream.get_final_message()
    expected = (_text(want), "max_tokens", want.usage.input_tokens, 12)
    for got in (whole, final, sync_final):
        assert (_text(got), got.stop_reason, got.usage.input_tokens, got.usage.output_tokens) == expected
    assert len(pieces) > 1 and "".join(pieces) == _text(want)


def test_stream_sends_anthropics_event_sequence(server: Server) -> None:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = [e["event"] for e in events]
    assert all(json.loads(e["data"])["type"] == e["event"] for e in events)
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    data = [json.loads(e["data"]) for e in events]
    assert data[0]["message"]["content"] == [] and data[0]["message"]["usage"]["output_tokens"] == 0
    assert data[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {d["delta"]["type"] for d in data if d["type"] == "content_block_delta"} == {"text_delta"}
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 6


def test_count_tokens_is_the_prompt_the_chat_endpoint_reports(
    client: anthropic.Anthropic, oai: openai.OpenAI, server: Server
) -> None:
    counted = client.messages.count_tokens(model=server.model, messages=MESSAGES, system=SYSTEM)
    assert counted.input_tokens == _chat(oai, server, 1).usage.prompt_tokens
    assert counted.input_tokens == _create(client, server, max_tokens=1).usage.input_tokens


def test_forced_tool_use_round_trip(client: anthropic.Anthropic, server: Server) -> None:
    ask: Any = {"model": server.model, "messages": ASK, "tools": ANTHROPIC_TOOLS, "max_tokens": 60}
    m = client.messages.create(**ask, tool_choice=WEATHER_TOOL, extra_body=HOT)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    m = client.messages.create(**{**ask, "max_tokens": 120}, extra_body=HOT,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})  # fmt: skip
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m.content
    schema = next(t["input_schema"] for t in ANTHROPIC_TOOLS if t["name"] == m.content[0].name)
    jsonschema.validate(m.content[0].input, schema)
    history: list[Any] = [*ASK, {"role": "assistant", "content": [use]},  # the SDK's own block, as agents send it
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": [{"type": "text", "text": "12 C"}]}]}]  # fmt: skip
    answer = client.messages.create(**{**ask, "messages": history, "max_tokens": 5}, extra_body=GREEDY)
    assert answer.stop_reason == "max_tokens" and [b.type for b in answer.content] == ["text"]
    counted = client.messages.count_tokens(model=server.model, messages=history, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == answer.usage.input_tokens


def test_a_streamed_forced_tool_use_sends_its_input_as_it_is_generated(
    client: anthropic.Anthropic, server: Server
) -> None:
    kw: Any = dict(model=server.model, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=WEATHER_TOOL, max_tokens=60,
                   extra_body=GREEDY)  # fmt: skip
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(pieces) > 2 and final.stop_reason == "tool_use"
    whole = client.messages.create(**kw)
    assert final.content[0].type == "tool_use" and final.content[0].input == whole.content[0].input
    jsonschema.validate(final.content[0].input, WEATHER)


def test_a_tool_use_cut_by_max_tokens_keeps_its_partial_input(client: anthropic.Anthropic, server: Server) -> None:
    kw: Any = dict(model=server.model, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=WEATHER_TOOL, max_tokens=7,
                   extra_body=GREEDY)  # fmt: skip
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for m in (whole, final):
        assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["tool_use"]
        assert m.content[0].name == "get_weather" and m.usage.output_tokens == 7
    assert isinstance(whole.content[0].input, dict) and whole.content[0].input == final.content[0].input


def _blocks(content: list[Any]) -> list[tuple[str, Any]]:
    """Each block's type and what it says (its text, or a tool use's name and input; not its new id)."""
    return [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in content]


def test_tool_use_the_model_writes_itself_is_parsed(hermes_server: Server) -> None:  # noqa: F811
    client = anthropic.Anthropic(base_url=hermes_server.url, api_key="x", timeout=120, max_retries=0)
    kw: Any = dict(model=hermes_server.model, messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=200, extra_body=GREEDY)
    for one, want in ((False, [PARIS, ROME]), (True, [PARIS])):  # disable_parallel_tool_use: the first call
        choice: Any = {"type": "auto", "disable_parallel_tool_use": one}
        m = client.messages.create(**kw, tool_choice=choice)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text"] + ["tool_use"] * len(want)
        assert m.content[0].text == "Let me check."
        uses = [(b.name, b.input) for b in m.content[1:] if b.type == "tool_use"]
        assert uses == [("get_weather", a) for a in want]
        with client.messages.stream(**kw, tool_choice=choice) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and _blocks(final.content) == _blocks(m.content)
    # the tools reach the template: counted with them, the prompt is the chat endpoint's with the same tools
    oai = openai.OpenAI(base_url=f"{hermes_server.url}/v1", api_key="x", timeout=120, max_retries=0)
    chat = oai.chat.completions.create(model=hermes_server.model, messages=ASK, tools=TOOLS, max_tokens=1)
    counted = client.messages.count_tokens(model=hermes_server.model, messages=ASK, tools=ANTHROPIC_TOOLS)
    plain = client.messages.count_tokens(model=hermes_server.model, messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens > plain.input_tokens
    none = client.messages.create(**kw, tool_choice={"type": "none"})  # no tools shown: no parsing
    assert [b.type for b in none.content] == ["text"]


# -- bad input: Anthropic's error shape, a 4xx, and nothing harmed -----------------------------------------------
def assert_anthropic_error(resp: httpx.Response, status: int, kind: str, *mentions: str) -> str:
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text[:500]}"
    assert "Traceback" not in resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    for word in mentions:
        assert word in message, f"{word!r} not in {message!r}"
    return message


def _bad_cases(model: str) -> list[tuple[dict[str, Any], int, str, tuple[str, ...]]]:
    ok: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    user = lambda *blocks: {**ok, "messages": [{"role": "user", "content": list(blocks)}]}  # noqa: E731
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    orphan = {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "12 C"}
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    return [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, 400, "invalid_request_error", ("max_tokens",)),
        ({**ok, "max_tokens": 0}, 400, "invalid_request_error", ("max_tokens=0", ">= 1")),
        ({**ok, "max_tokens": "4"}, 400, "invalid_request_error", ("max_tokens",)),
        ({**ok, "max_tokens": 10**6}, 400, "invalid_request_error", ("maximum context length", "1000000")),
        (user(image), 400, "invalid_request_error", ("'image'", "not supported")),
        (user({"type": "video", "url": "x"}), 400, "invalid_request_error", ("unknown content block type 'video'",)),
        ({**ok, "tools": ANTHROPIC_TOOLS * 2}, 400, "invalid_request_error", ("tool names must be unique",)),
        ({**ok, "tools": [{"name": "t", "input_schema": {"type": "string"}}]}, 400, "invalid_request_error",
         ("input_schema must be an object schema",)),
        (user({"type": "thinking", "thinking": "hm", "signature": "s"}), 400, "invalid_request_error",
         ("user message may not hold thinking",)),
        (user(orphan), 400, "invalid_request_error", ("tool_result", "toolu_nope")),
        (user(use), 400, "invalid_request_error", ("user message may not hold tool_use",)),
        (user({"type": "tool_result", "tool_use_id": "x", "content": [image]}), 400, "invalid_request_error",
         ("'image'",)),
        ({**ok, "messages": [*MESSAGES, {"role": "assistant", "content": "Well"}]}, 400, "invalid_request_error",
         ("prefilled",)),
        ({**ok, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error",
         ("thinking", "reasoning parser")),
        ({**ok, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
         "invalid_request_error", ("'nope'",)),
        ({**ok, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", ("needs tools",)),
        ({**ok, "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", ("name",)),
        ({**ok, "frequency_penalty": 1}, 400, "invalid_request_error", ("unsupported parameter: frequency_penalty",)),
        ({**ok, "messages": []}, 400, "invalid_request_error", ("messages",)),
        ({**ok, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", ("role",)),
        ({**ok, "temperature": -1}, 400, "invalid_request_error", ("temperature",)),
        ({**ok, "model": "claude-nope"}, 404, "not_found_error", ("claude-nope",)),
    ]  # fmt: skip


def test_bad_requests_get_anthropic_errors_and_the_server_stays_healthy(
    client: anthropic.Anthropic, server: Server
) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, status, kind, mentions in _bad_cases(server.model):
            assert_anthropic_error(http.post("/v1/messages", json=body), status, kind, *mentions)
            if body.get("max_tokens") == 4:  # a bad prompt side: count_tokens refuses it too
                del body["max_tokens"]
                assert_anthropic_error(http.post("/v1/messages/count_tokens", json=body), status, kind, *mentions)
        raw = {"content-type": "application/json"}
        assert_anthropic_error(http.post("/v1/messages", content=b'{"model": ', headers=raw), 400,
                               "invalid_request_error", "malformed JSON")  # fmt: skip
        assert_anthropic_error(http.post("/v1/messages/nope", json={}), 404, "not_found_error")
        assert_anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
        # the OpenAI endpoints keep their own shape
        r = http.post("/v1/chat/completions", json={"model": "claude-nope", "messages": MESSAGES})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "type" not in r.json()
        assert http.get("/health").status_code == 200
    with pytest.raises(anthropic.BadRequestError, match="reasoning parser"):
        client.messages.create(model=server.model, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024},
                               messages=MESSAGES)  # fmt: skip
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=MESSAGES)
    assert _create(client, server, max_tokens=3).usage.output_tokens == 3

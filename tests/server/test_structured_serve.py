"""Structured output and tool calling over HTTP, driven by the official `openai` SDK against a real server:
`beta.chat.completions.parse` with a pydantic model, response_format, vLLM's structured_outputs and guided_*
parameters, forced and required tool calls (streamed too), `tool_choice="auto"` on a model trained in the test
to emit Hermes `<tool_call>` blocks, and bad grammars as 400s that leave the server healthy."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.helpers import Server, running, train_tiny_llama

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather?"}]


class Person(BaseModel):
    name: str = Field(max_length=16)
    mood: Literal["happy", "sad"]
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0)


def test_parse_with_a_pydantic_model(client: openai.OpenAI, server: Server) -> None:
    for temperature in (0.0, 1.0):
        r = client.beta.chat.completions.parse(model=server.model, messages=ASK, response_format=Person,
                                               max_tokens=200, temperature=temperature, seed=3)  # fmt: skip
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Person) and r.choices[0].finish_reason == "stop"


def test_response_format_and_vllm_parameters(client: openai.OpenAI, server: Server) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["k", "n"], "additionalProperties": False}  # fmt: skip
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "kn", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(model=server.model, messages=ASK, response_format=fmt, max_tokens=60)
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), schema)
    text = client.completions.create(model=server.model, prompt="hello", max_tokens=60,
                                     extra_body={"response_format": fmt}).choices[0].text  # fmt: skip
    jsonschema.validate(json.loads(text), schema)
    plain = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=5,
                                           response_format={"type": "text"})  # fmt: skip
    assert plain.choices[0].finish_reason == "length"
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"regex": r"[a-c]{2,4}-\d"}}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d", t)),
        ({"guided_regex": r"\d{2,3}"}, lambda t: re.fullmatch(r"\d{2,3}", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ({"structured_outputs": {"json": schema}}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ({"guided_grammar": 'root ::= "<" [0-9] ">"'}, lambda t: re.fullmatch(r"<\d>", t)),
        ({"structured_outputs": {"grammar": 'start: "(" /[xy]{1,3}/ ")"'}},
         lambda t: re.fullmatch(r"\([xy]{1,3}\)", t)),
    ]  # fmt: skip
    for extra, ok in cases:
        for n in (1, 2):
            r = client.completions.create(model=server.model, prompt="hello", max_tokens=40, n=n, temperature=1.0,
                                          extra_body=extra)  # fmt: skip
            for c in r.choices:
                assert ok(c.text), (extra, c.text)


def test_forced_and_required_tool_calls(client: openai.OpenAI, server: Server) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice=named,
                                       max_tokens=60, temperature=1.0, seed=1)  # fmt: skip
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=2)  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == calls[0].function.name)
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]  # fmt: skip
    r = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=5)  # fmt: skip
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_a_streamed_forced_tool_call(client: openai.OpenAI, server: Server) -> None:
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    with client.beta.chat.completions.stream(model=server.model, messages=ASK, tools=strict, tool_choice=named,
                                             max_tokens=60, temperature=1.0, seed=4) as stream:  # fmt: skip
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    assert len(pieces) > 2  # the arguments came as they were generated, not in one piece
    call = (final.choices[0].message.tool_calls or [])[0]
    assert call.function.parsed_arguments is not None and final.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(call.function.parsed_arguments, WEATHER)


def test_bad_grammars_are_400s_and_the_server_stays_healthy(client: openai.OpenAI, server: Server) -> None:
    bad: list[dict[str, Any]] = [
        {"guided_json": {"type": "objec"}}, {"guided_regex": "a("}, {"structured_outputs": {"grammar": "start: x"}},
        {"structured_outputs": {"whitespace_pattern": " "}}, {"guided_regex": "a", "guided_choice": ["a"]},
        {"response_format": {"type": "json_schema"}}, {"response_format": {"type": "yaml"}},
        {"structured_outputs": {}},
    ]  # fmt: skip
    for extra in bad:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=server.model, prompt="x", max_tokens=4, extra_body=extra)
    for tool_choice in ({"type": "function", "function": {"name": "nope"}}, "required"):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, tool_choice=tool_choice,
                                           tools=TOOLS if tool_choice != "required" else openai.omit)  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="tool names must be unique"):
        client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS * 2, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="constrains the output already"):
        client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=4)  # fmt: skip
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert client.completions.create(model=server.model, prompt="x", max_tokens=3).choices[0].text is not None


# -- tool_choice="auto": a model that writes Hermes tool calls -------------------------------------------------
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: <tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    '</tools> Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PARIS, ROME = {"city": "Paris", "unit": "c"}, {"city": "Rome", "unit": "f"}
CALL = "Let me check." + "".join(f'\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(a)}}}\n</tool_call>'
                                 for a in (PARIS, ROME))  # fmt: skip


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Server]:
    """A tiny Llama trained here (a few seconds) to answer ASK with CALL (two calls), behind a Hermes-style
    template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("hermes")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.chat_template = HERMES_TEMPLATE
    prompt = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    p_ids = tok.encode(prompt, add_special_tokens=False)
    t_ids = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
    train_tiny_llama(tok, p_ids, t_ids, out)
    with running(out, tmp_path_factory.mktemp("hermes-log")) as s:
        yield s


def test_auto_tool_calls_are_parsed_from_the_model_output(hermes_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{hermes_server.url}/v1", api_key="x", timeout=120, max_retries=0)
    kw: dict[str, Any] = dict(model=hermes_server.model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
    for parallel, want in ((True, [PARIS, ROME]), (False, [PARIS])):  # parallel_tool_calls false: the first call
        r = client.chat.completions.create(**kw, parallel_tool_calls=parallel)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", msg
        assert msg.content == "Let me check." and msg.tool_calls and len(msg.tool_calls) == len(want)
        assert {c.function.name for c in msg.tool_calls} == {"get_weather"}
        assert [json.loads(c.function.arguments) for c in msg.tool_calls] == want
        content, calls, finish = "", [], None
        for chunk in client.chat.completions.create(**kw, parallel_tool_calls=parallel, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert content == "Let me check." and finish == "tool_calls"
        heads = [c for c in calls if c.id]  # the first piece of a call: id, type and name; then argument pieces
        assert [(c.index, c.function.name) for c in heads] == [(i, "get_weather") for i in range(len(want))]
        assert len(calls) > 2 * len(want)  # the arguments came in pieces
        arguments = ["".join(c.function.arguments or "" for c in calls if c.index == i) for i in range(len(want))]
        assert arguments == [c.function.arguments for c in msg.tool_calls]
    plain = client.chat.completions.create(**{**kw, "tool_choice": "none"})  # no tools shown: no parsing
    assert plain.choices[0].message.tool_calls is None

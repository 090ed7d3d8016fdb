"""Tool calls that stream, over HTTP with the `openai` and `anthropic` clients: `tool_choice` required (and
Anthropic's `any`) sends `tool_calls` deltas as the arguments are generated (first the id, type and name, then
argument pieces), whose joining is the non-streamed call; a call cut by max_tokens is still a call, with
finish_reason length; no chunk goes out empty. Also vLLM's `prompt_logprobs`, equal to the offline LLM's."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.server.helpers import Server
from tokenmill import LLM, SamplingParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK: list[Any] = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0)


def _streamed(client: openai.OpenAI, server: Server, **kw: Any) -> tuple[list[Any], str | None, int]:
    """(the tool_calls pieces, the finish reason, the number of chunks) of a streamed chat."""
    pieces, finish, chunks = [], None, 0
    for chunk in client.chat.completions.create(model=server.model, messages=ASK, stream=True, **kw):
        chunks += 1
        c = chunk.choices[0]
        delta = c.delta
        assert delta.role or delta.content or delta.tool_calls or c.finish_reason, chunk  # nothing goes out empty
        assert not delta.content, "a required call is not content"
        pieces += delta.tool_calls or []
        finish = c.finish_reason or finish
    return pieces, finish, chunks


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_stream_their_arguments(client: openai.OpenAI, server: Server, parallel: bool) -> None:
    kw: dict[str, Any] = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200,
                              temperature=0)  # fmt: skip
    whole = client.chat.completions.create(model=server.model, messages=ASK, **kw)
    calls = whole.choices[0].message.tool_calls or []
    assert calls and whole.choices[0].finish_reason == "tool_calls"
    pieces, finish, _ = _streamed(client, server, **kw)
    assert finish == "tool_calls"
    heads = [p for p in pieces if p.id]
    assert [(p.index, p.type, p.function.name) for p in heads] == [(i, "function", c.function.name)
                                                                   for i, c in enumerate(calls)]  # fmt: skip
    for i, call in enumerate(calls):
        args = "".join(p.function.arguments or "" for p in pieces if p.index == i)
        assert args == call.function.arguments and json.loads(args)["unit"] in ("c", "f")
    assert sum(1 for p in pieces if not p.id) > 3  # the arguments came in pieces, as they were generated


def test_a_call_cut_by_max_tokens_is_still_a_call(client: openai.OpenAI, server: Server) -> None:
    kw: dict[str, Any] = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    full = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=200, **kw)
    arguments = (full.choices[0].message.tool_calls or [])[0].function.arguments
    cut = full.usage.completion_tokens - 4  # inside the arguments: greedy writes the same tokens again
    whole = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=cut, **kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments != arguments
    assert arguments.startswith(call.function.arguments) and call.function.arguments.startswith("{")
    pieces, finish, chunks = _streamed(client, server, max_tokens=cut, **kw)
    assert finish == "length" and chunks < cut  # no flood of empty chunks while the name was being written
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_messages_any_streams_input_json_deltas(server: Server) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", timeout=120, max_retries=0)
    kw: dict[str, Any] = dict(model=server.model, max_tokens=200, messages=ASK, extra_body={"temperature": 0},
                              tools=[{"name": "get_weather", "input_schema": WEATHER}],
                              tool_choice={"type": "any", "disable_parallel_tool_use": True})  # fmt: skip
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        parts = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]  # fmt: skip
        final = stream.get_final_message()
    assert len(parts) > 3 and whole.stop_reason == final.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]


def test_prompt_logprobs_equal_the_offline_llm(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    prompt = [5, 17, 42, 99, 3, 250]
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})  # fmt: skip
    got = r.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    want = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, prompt_logprobs=2))
    expected = want[0].prompt_logprobs or []
    assert got[0] is None and len(got) == len(prompt) == len(expected)
    for pos, (g, e) in enumerate(zip(got[1:], expected[1:]), start=1):
        assert e is not None and {int(t) for t in g} == set(e) and str(prompt[pos]) in g
        for t, lp in e.items():
            assert g[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
        ranks = sorted(v["rank"] for v in g.values() if v["rank"] is not None)
        assert ranks == [1, 2]
    chat = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=server.model, prompt="x", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})  # fmt: skip

"""Tool-call plans (server/tools.py), parsing and streaming (server/tool_stream.py): Hermes and Llama 3 JSON formats,
split across deltas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmill.server import tool_stream, tools
from tokenmill.server.choice_stream import AnswerPlan, ChoiceStream, read_answer
from tokenmill.server.protocol import ChatCompletionRequest

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _plan(parser: str, **body: Any) -> tools.ToolPlan:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], **body)
    return tools.chat_plan(req, parser, "")


def _stream(plan: tools.ToolPlan, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    """The stream's content, and its calls with each one's argument pieces joined (in index order)."""
    ts, content, calls = tool_stream.ToolStream(plan), "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta = ts.feed(piece, i == len(pieces) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            call = calls.setdefault(d["index"], {"index": d["index"], "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += d.get("function", {}).get("name", "")
            call["function"]["arguments"] += d.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_are_parsed_whole_and_streamed(step: int) -> None:
    plan = _plan("hermes")
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "f", ' \
           '"arguments": {"x": 2}}</tool_call>'  # fmt: skip
    content, calls = tool_stream.parse(plan, text)
    assert content == "Sure." and [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {"x": 2}]
    streamed, deltas = _stream(plan, text, step)
    assert streamed == "Sure." and [d["index"] for d in deltas] == [0, 1]
    assert [json.loads(d["function"]["arguments"]) for d in deltas] == [{"x": 1}, {"x": 2}]


@pytest.mark.parametrize("step", [1, 4])
def test_text_that_only_looks_like_a_call_stays_content(step: int) -> None:
    plan = _plan("hermes")
    for text in ("a <tool is not a call", "x <tool_call>{broken</tool_call>", "trailing space  "):
        content, calls = tool_stream.parse(plan, text)
        assert calls == [] and content == text
        assert _stream(plan, text, step) == (text, [])


def test_llama3_json_calls() -> None:
    plan = _plan("llama3_json")
    content, calls = tool_stream.parse(plan, '<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; {"name": "f"}')
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": "b"}
    assert tool_stream.parse(plan, "just words") == ("just words", [])
    assert _stream(plan, '{"name": "f", "parameters": {}}', 2)[1][0]["function"]["name"] == "f"
    assert _stream(plan, "plain answer", 2) == ("plain answer", [])


def test_tool_choice_plans_and_constraints() -> None:
    named = _plan("auto", tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.mode == "named" and tools.constraint(named) is not None
    required = tools.constraint(_plan("auto", tool_choice="required", parallel_tool_calls=False))
    assert required is not None and isinstance(required.json, dict) and required.json["maxItems"] == 1
    several = tools.constraint(_plan("auto", tool_choice="required"))
    assert several is not None and isinstance(several.json, dict) and "maxItems" not in several.json
    assert tools.constraint(_plan("auto")) is None  # auto: free text, parsed after
    with pytest.raises(ValueError, match="not in tools"):
        _plan("auto", tool_choice={"type": "function", "function": {"name": "g"}})
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required")
    with pytest.raises(ValueError, match="needs tools"):
        tools.chat_plan(req, "auto", "")
    assert tools.chat_plan(req.model_copy(update={"tool_choice": None}), "auto", "<tool_call>").parser == "hermes"


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    ("parser", "text"),
    [("hermes", 'Let me check.\n<tool_call>\n{"name": "get_we'), ("hermes", "Sure <tool_call>"),
     ("hermes", 'Hm.\n<tool_call>{"na'), ("llama3_json", '{"name": "get_we'), ("llama3_json", "<|python_tag|>{")],
)  # fmt: skip
def test_a_call_cut_before_its_name_is_whole_is_content_streamed_as_whole(parser: str, text: str, step: int) -> None:
    """max_tokens ends the output inside a call's head: no call can be read, so the text is content, and the
    stream sends what the whole answer gives (it held the text back, waiting for the name)."""
    plan = _plan(parser)
    content, calls = tool_stream.parse(plan, text)
    assert calls == [] and content == text
    assert _stream(plan, text, step) == (text, [])


def _choice_stream(plan: tools.ToolPlan, text: str, step: int) -> tuple[str, list[dict[str, Any]], int]:
    """A ChoiceStream's content, its calls' pieces by index (joined), and its count of calls."""
    cs, content, calls = ChoiceStream(AnswerPlan(plan)), "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta = cs.feed(piece, i == len(pieces) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d.get("function", {}).get("name", "")
            call["arguments"] += d.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], cs.calls


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_call_of_auto(step: int, parallel: bool) -> None:
    """tool_choice auto with `parallel_tool_calls` false: the model's calls after the first are dropped, streamed and
    whole alike (vLLM does so); with it true (the default) every call stays."""
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "f", ' \
           '"arguments": {"x": 2}}</tool_call>'  # fmt: skip
    plan = _plan("hermes", parallel_tool_calls=parallel)
    assert plan.parallel is parallel
    want = [{"x": 1}, {"x": 2}] if parallel else [{"x": 1}]
    _, content, whole = read_answer(AnswerPlan(plan), text)
    assert content == "Sure." and [json.loads(c["function"]["arguments"]) for c in whole] == want
    streamed, calls, count = _choice_stream(plan, text, step)
    assert streamed == "Sure." and [json.loads(c["arguments"]) for c in calls] == want and count == len(want)

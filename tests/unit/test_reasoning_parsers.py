"""The server's readers of an output as it streams: reasoning parsers (qwen3 / deepseek_r1 `<think>`, gpt_oss
harmony channels), tool calls read as they are written, the engine's thinking-budget counter, and the count of
an output's reasoning tokens. Every streamed reading, in pieces of any size, must equal the whole one."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.engine.thinking import ThinkingBudgets
from tokenmill.sampling_params import ThinkingBudget
from tokenmill.server import tools
from tokenmill.server.choice_stream import AnswerPlan, ChoiceStream, read_answer
from tokenmill.server.reasoning import ReasoningParser, pick
from tokenmill.server.tool_stream import ToolStream, parse
from tokenmill.server.tools import ToolPlan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
QWEN3_TEMPLATE = "<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"


def _streamed(feed: Any, text: str, step: int) -> list[Any]:
    outs = [feed(text[i : i + step], False) for i in range(0, len(text), step)]
    return [*outs, feed("", True)]


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_think_tags_split_reasoning_from_the_answer_in_any_pieces(step: int) -> None:
    parser = pick("auto", QWEN3_TEMPLATE)
    assert parser is not None and parser.name == "qwen3"
    cases = [
        ("<think>\nI ponder.\n</think>\n\nHello", False, "\nI ponder.\n", "\n\nHello"),
        ("I ponder.\n</think>Hello <think>", True, "I ponder.\n", "Hello <think>"),  # the prompt opened it
        ("Hello, no thoughts", False, None, "Hello, no thoughts"),
        ("<think>cut short", False, "cut short", ""),
    ]
    for text, opened, reasoning, content in cases:
        outs = _streamed(parser.stream(opened).feed, text, step)
        assert "".join(r for r, _ in outs) == (reasoning or "") and "".join(c for _, c in outs) == content
        assert parser.split(text, opened) == (reasoning, content)


def test_the_parser_is_picked_from_the_template_and_the_prompt_says_whether_thinking_is_open() -> None:
    assert pick("auto", "{{ messages }}") is None and pick("none", QWEN3_TEMPLATE) is None
    r1 = pick("auto", "<｜Assistant｜><think>\n")
    assert r1 is not None and r1.name == "deepseek_r1" and r1.opened_by("<｜Assistant｜><think>\n")
    qwen3 = pick("qwen3", "")
    assert qwen3 is not None and not qwen3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    harmony = pick("auto", "<|channel|>analysis<|message|>")
    assert harmony is not None and harmony.name == "gpt_oss" and harmony.harmony


@pytest.mark.parametrize("step", [1, 3, 7, 200])
def test_harmony_channels_split_analysis_from_final(step: int) -> None:
    parser = pick("gpt_oss", "")
    assert parser is not None
    text = ("<|channel|>analysis<|message|>Think <b>hard</b>.<|end|><|start|>assistant<|channel|>final"
            "<|message|>The answer.<|return|>")  # fmt: skip
    outs = _streamed(parser.stream(False).feed, text, step)
    assert "".join(r for r, _ in outs) == "Think <b>hard</b>." and "".join(c for _, c in outs) == "The answer."
    assert parser.split(text, False) == ("Think <b>hard</b>.", "The answer.")


def _joined(outs: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for o in outs:
        content += o.get("content", "")
        for piece in o.get("tool_calls", []):
            if "id" in piece:
                calls[piece["index"]] = [piece["function"]["name"], ""]
            calls[piece["index"]][1] += piece["function"].get("arguments", "")
    return content, [(name, args) for name, args in calls.values()]


REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Pa\\"r}is", "unit": "c"}}, {"name": "add", "parameters": {"a": 1, "b": [2, {"x": 3}]}}]'  # noqa: E501
HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA3 = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'


@pytest.mark.parametrize("step", [1, 2, 9, 500])
@pytest.mark.parametrize(
    ("plan", "text", "content", "calls"),
    [
        (ToolPlan("required", "hermes"), REQUIRED, "",
         [("get_weather", '{"city": "Pa\\"r}is", "unit": "c"}'), ("add", '{"a": 1, "b": [2, {"x": 3}]}')]),
        (ToolPlan("required", "hermes"), REQUIRED[:50], "", [("get_weather", REQUIRED[39:50])]),  # cut by max_tokens
        (ToolPlan("auto", "hermes"), HERMES, "Let me check.", [("get_weather", '{"city": "Paris"}')]),
        (ToolPlan("auto", "hermes"), "x <tool_call>\nnot json</tool_call>", "x <tool_call>\nnot json</tool_call>",
         []),
        (ToolPlan("auto", "llama3_json"), LLAMA3, "", [("f", '{"a": 1}'), ("g", "{}")]),
        (ToolPlan("auto", "llama3_json"), '{"foo": 1} is JSON', '{"foo": 1} is JSON', []),
    ],
)  # fmt: skip
def test_tool_calls_stream_their_arguments_and_join_to_the_whole_reading(
    step: int, plan: ToolPlan, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    outs = _streamed(ToolStream(plan).feed, text, step)
    assert _joined(outs) == (content, calls)
    assert not any(o.get("tool_calls") == [] or o.get("content") == "" for o in outs)
    whole_content, whole_calls = parse(plan, text)
    assert ((whole_content or ""), [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]) == (
        content, calls)  # fmt: skip
    if step == 1 and calls:  # the arguments came in many pieces, as they were written
        assert sum(1 for o in outs if o.get("tool_calls")) > 5


def test_a_thinking_budget_forces_the_end_after_exactly_n_reasoning_tokens() -> None:
    start, end = (7,), (8, 9)  # "<think>", and an end of thinking of two tokens
    budgets = ThinkingBudgets()
    budgets.add("a", ThinkingBudget(3, end, start))
    taken = []
    for token in [5, 7, 1, 2, 3, 4, 4, 4]:  # what the model would write
        forced = budgets.forced("a")
        token = forced if forced is not None else token
        taken.append(token)
        budgets.accept("a", token)
    assert taken == [5, 7, 1, 2, 3, 8, 9, 4] and budgets.free_tokens("a") is None
    budgets.add("b", ThinkingBudget(5, end, start, opened=True))  # the prompt opened it; the model ends it first
    assert budgets.free_tokens("b") == 5
    for token in [1, 8, 9]:
        budgets.accept("b", token)
    assert budgets.forced("b") is None and budgets.free_tokens("b") is None
    budgets.add("c", ThinkingBudget(0, end, opened=True))
    assert budgets.forced("c") == 8 and budgets.free_tokens("c") == 0
    with pytest.raises(ValueError, match="thinking_token_budget"):
        ThinkingBudget(-1, end, start)


def test_reasoning_tokens_are_counted_between_the_markers() -> None:
    """`usage.output_tokens_details.reasoning_tokens` of the Responses API: the markers are not counted."""
    tools = ToolPlan("none", "hermes")
    think, harmony = _parser("qwen3"), _parser("gpt_oss")
    start, end = (7,), (8,)  # "<think>" and "</think>"
    assert AnswerPlan(tools, think, False, (start, end)).reasoning_tokens([5, 7, 1, 2, 8, 3, 7, 4, 8]) == 2
    assert AnswerPlan(tools, think, True, (start, end)).reasoning_tokens([1, 2, 3, 8, 4]) == 3  # the prompt opened it
    assert AnswerPlan(tools, think, False, (start, end)).reasoning_tokens([7, 1, 2]) == 2  # cut short
    assert AnswerPlan(tools, think, False, (start, end)).reasoning_tokens([1, 2]) == 0
    analysis, close = (20, 21, 22), (23,)  # "<|channel|>analysis<|message|>" and "<|end|>"
    output = [*analysis, 1, 2, *close, 20, 30, 22, 3, *close, *analysis, 4, *close, 24]  # analysis, final, analysis
    assert AnswerPlan(tools, harmony, False, (analysis, close)).reasoning_tokens(output) == 3
    assert AnswerPlan(tools).reasoning_tokens(output) == 0  # no parser


def _parser(name: str) -> ReasoningParser:
    parser = pick(name, "")
    assert parser is not None
    return parser


HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": [1, 2]}<|call|>'
)
HARMONY_TWO = (
    '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>'
    "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
)  # the recipient in the role part


@pytest.mark.parametrize("step", [1, 4, 11, 500])
@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [(HARMONY_CALL, "Need the weather.", "", [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
     (HARMONY_TWO, "", "Done.", [("add", '{"a": 1}')]),
     (HARMONY_CALL[:-20], "Need the weather.", "", [("get_weather", '{"city": "Paris", "da')])],  # max_tokens
)  # fmt: skip
def test_harmony_messages_to_a_function_are_tool_calls_streamed_as_written(
    step: int, text: str, reasoning: str, content: str, calls: list[tuple[str, str]]
) -> None:
    parser = pick("auto", "<|channel|>analysis<|message|>")
    assert parser is not None
    plan = AnswerPlan(tools.plan([WEATHER], "auto", "auto", "<|channel|>analysis"), parser)
    assert plan.tools.parser == "openai"
    stream = ChoiceStream(plan)
    outs = _streamed(stream.feed, text, step)
    assert "".join(o.get("reasoning_content", "") for o in outs) == reasoning
    assert _joined(outs) == (content, calls) and stream.calls == len(calls)
    assert not any(o.get("tool_calls") == [] for o in outs)
    whole = read_answer(plan, text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole[2]] == calls
    assert (whole[0] or "", whole[1] or "") == (reasoning, content)
    if step == 1:  # the arguments came in many pieces, as they were written
        assert sum(1 for o in outs if o.get("tool_calls")) > 5


def test_without_tools_a_harmony_message_to_a_function_stays_answer_text() -> None:
    parser = pick("gpt_oss", "")
    assert parser is not None
    plan = AnswerPlan(tools.plan([], None, "auto", "<|channel|>"), parser)
    reasoning, content, calls = read_answer(plan, HARMONY_CALL)
    assert calls == [] and reasoning == "Need the weather." and content == '{"city": "Paris", "days": [1, 2]}'

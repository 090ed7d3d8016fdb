"""One chat answer's text read as it streams or whole: reasoning first (reasoning.py, when a parser is on), then
the answer through the tool calls' reader (tool_stream.py). Chat completions and the Messages API both read their
outputs here, so a streamed answer is its whole one cut in pieces.

Must not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.sampling_params import SamplingParams, ThinkingBudget
from tokenmill.server.reasoning import ReasoningParser, ReasoningStream
from tokenmill.server.tool_stream import ToolStream, parse
from tokenmill.server.tools import ToolPlan
from tokenmill.tokenizer import Tokenizer

PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens read to see whether it opened the thinking


@dataclass(frozen=True)
class AnswerPlan:
    """How a request's output is read: its tool plan, and its reasoning parser with whether the prompt opened the
    thinking."""

    tools: ToolPlan
    reasoning: ReasoningParser | None = None
    opened: bool = False
    # the token ids that open a stretch of thinking and that close it (`</think>`; gpt_oss: `<|end|>`)
    markers: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of an output's tokens are reasoning: those inside the thinking, its markers not counted (as a
        thinking budget counts them). `<think>` parsers: the first thinking only; gpt_oss: every analysis message."""
        if self.reasoning is None:
            return 0
        (start, close), again = self.markers, self.reasoning.harmony
        count, thinking, i = 0, self.opened, 0
        while i < len(token_ids):
            marker = close if thinking else start
            if marker and tuple(token_ids[i : i + len(marker)]) == marker:
                if thinking and not again:
                    return count
                thinking, i = not thinking, i + len(marker)
                continue
            count += thinking
            i += 1
        return count

    def budget(self, tok: Tokenizer, max_tokens: int | None) -> ThinkingBudget | None:
        """The engine's thinking budget for `max_tokens` reasoning tokens (None: no budget). ValueError without
        a reasoning parser."""
        if max_tokens is None:
            return None
        if self.reasoning is None:
            raise ValueError("a thinking budget needs a reasoning parser: start the server with --reasoning-parser")
        p = self.reasoning
        return ThinkingBudget(max_tokens, tuple(tok.encode(p.end, add_special_tokens=False)),
                              tuple(tok.encode(p.start, add_special_tokens=False)), self.opened)  # fmt: skip


def with_reasoning(params: SamplingParams, answer: AnswerPlan, tok: Tokenizer, budget: int | None) -> SamplingParams:
    """`params` with the thinking budget, and with special tokens kept in the text where the reasoning parser reads
    them (harmony's channels). ValueError for a budget without a parser."""
    thinking = answer.budget(tok, budget)
    harmony = answer.reasoning is not None and answer.reasoning.harmony
    if thinking is None and not harmony:
        return params
    return replace(params, thinking=thinking, skip_special_tokens=params.skip_special_tokens and not harmony)


def answer_plan(tools: ToolPlan, reasoning: ReasoningParser | None, tok: Tokenizer, prompt: list[int]) -> AnswerPlan:
    if reasoning is None:
        return AnswerPlan(tools)
    tail = tok.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    start = tuple(tok.encode(reasoning.start, add_special_tokens=False))
    close = tuple(tok.encode("<|end|>" if reasoning.harmony else reasoning.end, add_special_tokens=False))
    return AnswerPlan(tools, reasoning, reasoning.opened_by(tail), (start, close))


class ChoiceStream:
    """One choice's text deltas in, chat `delta` fields out: `reasoning_content`, `content`, `tool_calls`."""

    def __init__(self, plan: AnswerPlan) -> None:
        self.tools, self.parallel = ToolStream(plan.tools), plan.tools.parallel
        self.reasoning: ReasoningStream | None = None
        if plan.reasoning is not None:
            self.reasoning = plan.reasoning.stream(plan.opened, reads_harmony_calls(plan.tools))

    @property
    def calls(self) -> int:
        n = self.tools.calls + (len(self.reasoning.calls) if self.reasoning is not None else 0)
        return n if self.parallel else min(n, 1)

    def feed(self, delta: str, finished: bool) -> dict[str, Any]:
        thought, calls = "", []
        if self.reasoning is not None:
            thought, delta = self.reasoning.feed(delta, finished)
            calls = self.reasoning.take_calls()  # harmony's: the tool stream then reads none
        out = self.tools.feed(delta, finished) if delta or finished else {}
        if calls:
            out["tool_calls"] = calls
        if not self.parallel and "tool_calls" in out:  # one call allowed: the first's pieces, none of the others'
            out["tool_calls"] = [c for c in out["tool_calls"] if c["index"] == 0]
            if not out["tool_calls"]:
                del out["tool_calls"]
        return {"reasoning_content": thought, **out} if thought else out


def reads_harmony_calls(tools: ToolPlan) -> bool:
    """Whether harmony messages to a function are read as tool calls: tools given, `tool_choice` auto, and the
    `openai` parser (gpt-oss's; a forced call's output is the grammar's JSON, read by the tool stream)."""
    return tools.mode == "auto" and tools.parser == "openai"


def read_answer(plan: AnswerPlan, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """(reasoning or None, content, tool calls) of a finished output."""
    reasoning, harmony_calls = None, list[dict[str, Any]]()
    if plan.reasoning is not None:
        reasoning, text, harmony_calls = plan.reasoning.read(text, plan.opened, reads_harmony_calls(plan.tools))
    content, calls = parse(plan.tools, text)
    calls = (harmony_calls + calls)[: None if plan.tools.parallel else 1]
    if reasoning is not None and not content:
        content = None
    return reasoning, content, calls

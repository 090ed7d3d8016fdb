"""Reasoning parsers: a reasoning model's thinking told apart from its answer, whole or as it streams
(`--reasoning-parser`).

- `qwen3`, `deepseek_r1`: `<think>...</think>` then the answer. Whether the output starts inside the thinking is
  read from the prompt: a template that opens `<think>` itself (DeepSeek-R1, Qwen3 thinking models) leaves it last
  in the prompt; Qwen3's `enable_thinking: false` writes an empty `<think>\\n\\n</think>` there, so nothing of
  the output is reasoning. Otherwise the model's own `<think>` opens it.
- `gpt_oss`: harmony channels, `<|channel|>analysis<|message|>...<|end|>` then
  `<|start|>assistant<|channel|>final<|message|>...`: the analysis channel is reasoning, any other the answer.
  Its markers are special tokens, so the request keeps them in its text (`skip_special_tokens` off). A message
  to a function (`to=functions.NAME` in its header, on the commentary channel, ended by `<|call|>`) is a tool
  call where the request reads calls (`stream(opened, calls=True)`): its body streams as the call's arguments.
- `auto` (the default) picks one by the chat template where that is clear, else none.

`ReasoningParser.end` is what ends the thinking when a thinking budget is spent (the engine forces its tokens:
sampling_params.ThinkingBudget). Every API reads reasoning through `ReasoningStream` (chat completions, Messages;
the Responses API's reasoning items may too).

Must not import torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenmill.server.tools import new_call_id

PARSERS = ("auto", "none", "qwen3", "deepseek_r1", "gpt_oss")
_THINK = re.compile(r"<think>|</think>")
# a harmony header (role, channel, recipient, constraint) up to <|message|>, or the end of a message
_HARMONY = re.compile(
    r"(?:<\|start\|>[^<]*)?<\|channel\|>(\w*)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>|<\|end\|>|<\|return\|>|<\|call\|>"
)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")  # a harmony header's function recipient
_HARMONY_OPENERS = ("<|start|>", "<|channel|>")
_HARMONY_TAGS = (*_HARMONY_OPENERS, "<|end|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class ReasoningParser:
    name: str  # "qwen3" | "deepseek_r1" | "gpt_oss"
    start: str  # the text that opens the thinking
    end: str  # the text that ends it, as a spent budget forces it

    @property
    def harmony(self) -> bool:
        return self.name == "gpt_oss"

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether the output starts inside the thinking: the prompt (its last few tokens' text) opens it."""
        return not self.harmony and prompt_tail.rstrip().endswith(self.start)

    def stream(self, opened: bool, calls: bool = False) -> ReasoningStream:
        """`calls`: harmony messages to a function are tool calls (ReasoningStream.take_calls), not answer."""
        return ReasoningStream(self, opened, calls)

    def split(self, text: str, opened: bool) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a finished output: its stream's pieces joined."""
        reasoning, content, _ = self.read(text, opened)
        return reasoning, content

    def read(self, text: str, opened: bool, calls: bool = False) -> tuple[str | None, str, list[dict[str, Any]]]:
        """(reasoning or None, answer, tool calls as a chat message holds them) of a finished output."""
        stream = self.stream(opened, calls)
        reasoning, content = stream.feed(text, True)
        found = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in stream.calls]  # fmt: skip
        return (reasoning if reasoning or opened or self._wrote_start(text) else None), content, found

    def _wrote_start(self, text: str) -> bool:
        return self.start in text


_THINKING = {
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>"),
    "deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>"),
    "gpt_oss": ReasoningParser("gpt_oss", "<|channel|>analysis<|message|>",
                               "<|end|><|start|>assistant<|channel|>final<|message|>"),
}  # fmt: skip


def pick(flag: str, chat_template: str) -> ReasoningParser | None:
    """The parser `--reasoning-parser` names; `auto`: by the chat template (harmony channels: gpt_oss; `<think>`:
    qwen3 with ChatML's `<|im_start|>`, else deepseek_r1), none where it shows neither."""
    if flag == "none":
        return None
    if flag != "auto":
        return _THINKING[flag]
    if "<|channel|>" in chat_template and "analysis" in chat_template:
        return _THINKING["gpt_oss"]
    if "<think>" in chat_template:
        return _THINKING["qwen3" if "<|im_start|>" in chat_template else "deepseek_r1"]
    return None


class ReasoningStream:
    """One output's text in, (reasoning, answer) pieces out. A marker's first characters are held back until it
    is known whether they begin one."""

    def __init__(self, parser: ReasoningParser, opened: bool, calls: bool = False) -> None:
        self.parser, self.reasoning, self.text, self.pos = parser, opened, "", 0
        self.ended = False  # <think> parsers: the thinking has ended; no marker is read any more
        self.read_calls = calls and parser.harmony
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"}: harmony's function calls so far
        self.in_call = False  # the current message is a call's: its text is the arguments
        self._pieces: list[dict[str, Any]] = []  # chat `tool_calls` pieces not yet taken

    def take_calls(self) -> list[dict[str, Any]]:
        """The chat `tool_calls` pieces read since the last take: a call's id, type and name once its header is
        whole, then its arguments as they are written."""
        pieces, self._pieces = self._pieces, []
        return pieces

    def _into_call(self, piece: str) -> None:
        if not piece:
            return
        self.calls[-1]["arguments"] += piece
        last = self._pieces[-1] if self._pieces else None
        if last is not None and last["index"] == len(self.calls) - 1:
            last["function"]["arguments"] += piece
        else:
            self._pieces.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})

    def _header(self, header: str, channel: str | None) -> None:
        """A harmony header or end of message: which stream the message's text goes to."""
        if channel is not None:
            self.reasoning = channel == "analysis"
        called = _RECIPIENT.search(header) if self.read_calls and channel is not None else None
        self.in_call = called is not None
        if called is not None:
            call = {"id": new_call_id(), "name": called.group(1), "arguments": ""}
            self.calls.append(call)
            self._pieces.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                 "function": {"name": call["name"], "arguments": ""}})  # fmt: skip

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        reasoning: list[str] = []
        content: list[str] = []
        markers = _HARMONY if self.parser.harmony else _THINK
        while True:
            m = markers.search(self.text, self.pos) if not self.ended else None
            upto = m.start() if m is not None else len(self.text) - (0 if finished else self._held())
            if self.in_call:
                self._into_call(self.text[self.pos : upto])
            else:
                (reasoning if self.reasoning else content).append(self.text[self.pos : upto])
            self.pos = max(self.pos, upto)
            if m is None:
                return "".join(reasoning), "".join(content)
            self.pos = m.end()
            if self.parser.harmony:
                self._header(m.group(0), m.group(1))
            else:  # the first </think> ends the thinking: what follows is answer, a later <think> too (as vLLM's)
                self.reasoning, self.ended = m.group(0) == "<think>", m.group(0) == "</think>"

    def _held(self) -> int:
        """How many characters at the end may begin a marker."""
        rest = self.text[self.pos :]
        if self.ended:
            return 0
        tags: tuple[str, ...] = ("<think>", "</think>")
        if self.parser.harmony:
            opened = [rest.find(t) for t in _HARMONY_OPENERS if t in rest]  # a header still being written
            if opened:
                return len(rest) - min(opened)
            tags = _HARMONY_TAGS
        for k in range(min(max(len(t) for t in tags) - 1, len(rest)), 0, -1):
            if any(t.startswith(rest[-k:]) for t in tags):
                return k
        return 0

"""Tool calls read from an output as it is generated, so that their arguments stream (as vLLM streams them): a call's
first delta carries its id, type and name, later ones pieces of its arguments, as the model writes them.

`CallReader` reads JSON call objects, `{"name": N, "arguments" | "parameters": V}`, from a growing text: the name
once its string is complete, then V's raw text piece by piece. `ToolStream` puts it behind each `tool_choice`:
- a named function: the whole output is the arguments;
- `"required"`: the output is a JSON array of calls;
- `"auto"`: content until the model's own call format starts (Hermes `<tool_call>`, or Llama 3 JSON at the start
  of the message), then calls.

A call cut by `max_tokens` stays a call, with the arguments written so far. `parse` reads a finished output
through the same `ToolStream`, so a non-streamed call's arguments are the streamed pieces joined.

Must not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.server.tools import HERMES_OPEN, PYTHON_TAG, ToolPlan, new_call_id, parse_whole

# the head of a call object, up to where its arguments begin
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_HEAD_START = '{"name":"'
_BARE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*\}')  # a call without arguments: they are {}
_CLOSE = re.compile(r"\s*\}")  # the end of a call object, after its arguments
_MAX_HEAD = 400  # characters a call's head may take before it is not one
# what may come between calls, by the call format: a JSON array's, Hermes blocks', Llama 3's `;`
_BETWEEN = {"required": re.compile(r"[\s\[\],]*"), "hermes": re.compile(r"(?:\s|</?tool_call>)*"),
            "llama3_json": re.compile(r"(?:\s|;|<\|python_tag\|>)*")}  # fmt: skip
_SEPARATORS = {"required": (), "hermes": ("<tool_call>", "</tool_call>"), "llama3_json": (PYTHON_TAG,)}


class CallReader:
    """Calls in a growing text, in the call format `style` ("required", "hermes" or "llama3_json")."""

    def __init__(self, style: str) -> None:
        self.between, self.separators = _BETWEEN[style], _SEPARATORS[style]
        self.text, self.pos, self.state = "", 0, "between"  # between | head | value | tail | done | broken
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"} as read so far
        self._depth, self._in_string, self._escaped = 0, False, False

    @property
    def broken(self) -> bool:
        return self.state == "broken"

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Read `delta`; returns the chat `tool_calls` pieces it completes."""
        self.text += delta
        pieces: list[dict[str, Any]] = []
        moved = True
        while moved:
            before = (self.state, self.pos)
            getattr(self, "_" + self.state)(pieces)
            moved = (self.state, self.pos) != before
        return pieces

    def _between(self, pieces: list[dict[str, Any]]) -> None:
        m = self.between.match(self.text, self.pos)
        self.pos = m.end() if m else self.pos
        rest = self.text[self.pos :]
        if rest.startswith("{"):
            self.state = "head"
        elif rest and not any(s.startswith(rest) for s in self.separators):
            self.state = "done"  # text after the calls: not read (as the whole-text parsers drop it)

    def _head(self, pieces: list[dict[str, Any]]) -> None:
        m = _HEAD.match(self.text, self.pos)
        bare = _BARE.match(self.text, self.pos) if m is None else None
        if bare is not None:  # (the whole-text parsers took such a call too)
            self._start_call(bare.group(1), pieces, "{}")
            self.pos, self.state = bare.end(), "between"
            return
        if m is None:
            squeezed = re.sub(r"\s", "", self.text[self.pos : self.pos + _MAX_HEAD])
            if not squeezed.startswith(_HEAD_START[: len(squeezed)]) or len(self.text) - self.pos >= _MAX_HEAD:
                self.state = "broken"
            return
        if self._start_call(m.group(1), pieces, ""):
            self.pos, self.state = m.end(), "value"
            self._depth, self._in_string, self._escaped = 0, False, False

    def _start_call(self, quoted_name: str, pieces: list[dict[str, Any]], arguments: str) -> bool:
        """A new call named by the JSON string body `quoted_name` (False, and broken, where it is no string)."""
        try:
            name = json.loads(f'"{quoted_name}"')
        except ValueError:
            self.state = "broken"
            return False
        call = {"id": new_call_id(), "name": name, "arguments": arguments}
        self.calls.append(call)
        pieces.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                       "function": {"name": name, "arguments": arguments}})  # fmt: skip
        return True

    def _value(self, pieces: list[dict[str, Any]]) -> None:
        start, end = self.pos, self._value_end()
        self.pos = end if end is not None else len(self.text)
        piece = self.text[start : self.pos]
        if piece:
            self.calls[-1]["arguments"] += piece
            last = pieces[-1] if pieces else None
            if last is not None and last["index"] == len(self.calls) - 1:
                last["function"]["arguments"] += piece
            else:
                pieces.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        if end is not None:
            self.state = "tail"

    def _value_end(self) -> int | None:
        """Where the arguments' JSON value ends (None: not yet), scanning from `pos` and keeping the scan's state."""
        for i in range(self.pos, len(self.text)):
            ch = self.text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return i + 1  # a string value
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]" or (ch == "," and self._depth == 0):
                if self._depth == 0:
                    return i  # a number, true, false or null, ended by what follows it
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _tail(self, pieces: list[dict[str, Any]]) -> None:
        m = _CLOSE.match(self.text, self.pos)
        if m is not None:
            self.pos, self.state = m.end(), "between"
        elif self.text[self.pos :].strip():
            self.state = "broken"  # more keys after the arguments: not a call this reader follows

    def _done(self, pieces: list[dict[str, Any]]) -> None:
        pass

    def _broken(self, pieces: list[dict[str, Any]]) -> None:
        pass


class ToolStream:
    """One choice's stream: text deltas in, chat `delta` fields out (`content`, `tool_calls`)."""

    def __init__(self, p: ToolPlan) -> None:
        self.plan, self.text, self.sent = p, "", 0  # sent: characters of text sent as content
        self.call_id = new_call_id()
        self.reader: CallReader | None = CallReader("required") if p.mode == "required" else None
        self.gave_up = False  # auto: what looked like a call was not one; the rest is content

    @property
    def calls(self) -> int:
        if self.plan.mode == "named":
            return 1
        return len(self.reader.calls) if self.reader is not None else 0

    def feed(self, delta: str, finished: bool) -> dict[str, Any]:
        """The delta fields for new text `delta` (empty when nothing can be sent yet)."""
        self.text += delta
        p = self.plan
        if p.mode == "named":  # the text is the arguments: stream them
            if self.sent == 0:
                self.sent = 1
                call = {"index": 0, "id": self.call_id, "type": "function",
                        "function": {"name": p.function, "arguments": delta}}  # fmt: skip
                return {"tool_calls": [call]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else {}
        if p.mode == "none" or (p.mode == "auto" and p.parser == "openai"):  # (openai: harmony's calls come
            return {"content": delta} if delta else {}  # from the reasoning stream: reasoning.py)
        if p.mode == "required":
            assert self.reader is not None
            pieces = self.reader.feed(delta)
            return {"tool_calls": pieces} if pieces else {}
        return self._auto(delta, finished)

    def _auto(self, delta: str, finished: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.reader is None:
            start = self._call_start()
            if start is None:  # no call (yet): content, but never what may begin one
                upto = len(self.text) if finished else self._safe_end()
                if upto > self.sent:
                    out["content"], self.sent = self.text[self.sent : upto], upto
                return out
            before = self.text[self.sent : start].rstrip()  # whitespace before a call is not content
            if before:
                out["content"] = before
            self.sent += len(before)
            self.reader = CallReader(self.plan.parser)
            delta = self.text[start:]
        pieces = self.reader.feed(delta)
        if pieces:
            out["tool_calls"] = pieces
        # not a call after all (or cut by the output's end before its name was whole): content
        if (finished or self.reader.state in ("broken", "done")) and not self.reader.calls:
            self.reader, self.gave_up = None, True
            if finished:
                rest = self.text[self.sent :]
                if rest:
                    out["content"] = out.get("content", "") + rest
                self.sent = len(self.text)
        return out

    def _call_start(self) -> int | None:
        """Where the model's call format starts in the text, once it is sure to: None while it is not."""
        if self.gave_up:
            return None
        if self.plan.parser == "hermes":
            at = self.text.find(HERMES_OPEN, self.sent)
            return at if at >= 0 else None
        lead = self.text.lstrip()
        if self.sent == 0 and (lead.startswith("{") or lead.startswith(PYTHON_TAG)):
            return len(self.text) - len(lead)
        return None

    def _safe_end(self) -> int:
        """How much text can go out as content: none while a call may be beginning, and never a tag's prefix."""
        if self.plan.parser == "llama3_json":  # a call is the whole message: wait until it cannot be one
            lead = self.text.lstrip()
            maybe_call = not lead or lead[0] == "{" or PYTHON_TAG.startswith(lead[: len(PYTHON_TAG)])
            return 0 if maybe_call and self.sent == 0 and not self.gave_up else len(self.text)
        end = len(self.text)
        if self.gave_up:
            return end
        for k in range(min(len(HERMES_OPEN) - 1, end), 0, -1):  # hold back "<tool" at the end
            if HERMES_OPEN.startswith(self.text[end - k : end]):
                end -= k
                break
        return max(len(self.text[:end].rstrip()), self.sent)  # and trailing whitespace: it may precede a call


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output: what its stream sends, joined. A model's own calls that the
    stream could not follow are read whole (tools.parse_whole)."""
    if p.mode == "none" or (p.mode == "auto" and p.parser == "openai"):
        return text, []
    stream = ToolStream(p)
    out = stream.feed(text, True)
    if p.mode == "named":
        return None, [{"id": stream.call_id, "type": "function", "function": {"name": p.function, "arguments": text}}]
    reader = stream.reader
    if reader is None or not reader.calls:
        return (None, []) if p.mode == "required" else parse_whole(p, text)
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in reader.calls]  # fmt: skip
    content = out.get("content")
    return (content or None), calls

"""Anthropic's message shape, whole or as its stream of server-sent events, from one engine request.

The text goes through the same `ChoiceStream` (streaming) or `read_answer` (whole) as a chat completion's;
`Blocks` turns the chat deltas it gives into content blocks, so that both APIs read reasoning and tool calls one
way. The stream is Anthropic's: `message_start`, then per block `content_block_start`, `content_block_delta`s
(`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop` (with one `ping` after the first
block starts), then `message_delta` (stop reason and usage) and `message_stop`; a failure mid-stream is an `error`
event. Every tool call's input streams as it is generated (tool_stream.py).

Must not import torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic_core import from_json

from tokenmill.outputs import CompletionOutput
from tokenmill.server.choice_stream import AnswerPlan, ChoiceStream, read_answer
from tokenmill.server.errors import anthropic_error_body
from tokenmill.server.streaming import Call, merged, sse

ABORTED = "the request was aborted: the server is shutting down; retry"


def stop_reason(out: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the output or None)."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use input object. Arguments cut short by max_tokens are read as far as they
    go, as the `anthropic` SDK reads a streamed input (partial JSON)."""
    try:
        value = from_json(arguments, allow_partial=True) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(call: Call, plan: AnswerPlan, out: CompletionOutput) -> dict[str, Any]:
    """The whole message for a finished output."""
    thought, content, calls = read_answer(plan, out.text)
    blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    blocks += [{"type": "text", "text": content}] if content else []
    for c in calls:
        f = c["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(c["id"]), "name": f["name"],
                       "input": tool_input(f["arguments"])})  # fmt: skip
    reason, sequence = stop_reason(out, bool(calls))
    return {"id": call.id, "type": "message", "role": "assistant", "model": call.model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(call.prompts[0]), "output_tokens": len(out.token_ids)}}  # fmt: skip


def _event(kind: str, **fields: Any) -> str:
    return sse({"type": kind, **fields}, event=kind)


class Blocks:
    """Content-block events from chat deltas (`{"reasoning_content"?, "content"?, "tool_calls"?}`, as `ChoiceStream`
    gives them).
    Blocks are sent one after another: a new one closes the open one."""

    def __init__(self) -> None:
        self.index = -1  # the open (or last) block's index
        self.open: str | None = None  # its type while open
        self.tool_blocks: dict[int, int] = {}  # a chat delta's tool-call index -> its block index
        self.pinged = False

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in self.tool_blocks:
                events += self._start({"type": "tool_use", "id": tool_use_id(piece["id"]),
                                       "name": piece["function"]["name"], "input": {}})  # fmt: skip
                self.tool_blocks[piece["index"]] = self.index
            arguments = piece["function"].get("arguments")
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[str]:
        events = []
        if self.open == "thinking":  # the SDK's thinking block ends with its signature (tokenmill signs nothing)
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        events += [_event("content_block_stop", index=self.index)] if self.open else []
        self.open = None
        if not self.pinged:
            self.pinged = True
            events.append(_event("ping"))
        return events

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close() if self.open else []
        self.index += 1
        self.open = block["type"]
        events.append(_event("content_block_start", index=self.index, content_block=block))
        if not self.pinged:
            self.pinged = True
            events.append(_event("ping"))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)


async def message_events(call: Call, plan: AnswerPlan) -> AsyncIterator[str]:
    """The message's SSE, as the `anthropic` SDK's `messages.stream()` assembles it."""
    usage = {"input_tokens": len(call.prompts[0]), "output_tokens": 0}
    start: dict[str, Any] = {"id": call.id, "type": "message", "role": "assistant", "model": call.model,
                             "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}  # fmt: skip
    yield _event("message_start", message=start)
    text, blocks = ChoiceStream(plan), Blocks()
    final: CompletionOutput | None = None
    try:
        async for _, out in merged(call):
            c = out.outputs[0]
            for event in blocks.feed(text.feed(out.new_text[0], c.finish_reason is not None)):
                yield event
            if out.finished:
                final = c
                call.observe(out)
    except Exception as e:  # the request failed in the engine, or the engine died: say so in-band, then end
        yield sse(anthropic_error_body(500, f"generation failed: {e}"), event="error")
        return
    if final is None or final.finish_reason == "abort":  # the server is shutting down (launch.py)
        yield sse(anthropic_error_body(503, ABORTED), event="error")
        return
    for event in blocks.close():
        yield event
    reason, sequence = stop_reason(final, text.calls > 0)
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                 usage={**usage, "output_tokens": len(final.token_ids)})  # fmt: skip
    yield _event("message_stop")

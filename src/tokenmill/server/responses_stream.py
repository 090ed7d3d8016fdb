"""A streamed Responses API answer: OpenAI's typed server-sent events, each with its `sequence_number`, in the
order the `openai` SDK's `responses.stream()` assembles:

1. `response.created`, `response.in_progress` (the response with no output yet);
2. per output item, `response.output_item.added`, then
   - a message: `response.content_part.added`, `response.output_text.delta`s, `response.output_text.done`,
     `response.content_part.done`;
   - a function call: `response.function_call_arguments.delta`s, `response.function_call_arguments.done`;
   then `response.output_item.done`;
3. `response.completed`, with the whole response. Its `status` is `incomplete` when max_output_tokens cut the
   output (as vLLM does: the SDK's `get_final_response` needs `response.completed`).
A failure mid-stream is an `error` event, then `response.failed`.

The text goes through the same `tools.ToolStream` as a chat completion's; `Items` turns the chat deltas it gives
into output items. A forced function streams its arguments as they are generated; tool calls the model writes
itself (`auto`) or that `required` constrains are read when the output is complete, each sent whole then.

Must not import torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.outputs import RequestOutput
from tokenmill.server import tool_stream, tools
from tokenmill.server.responses_output import (
    ABORTED,
    ResponseHead,
    function_call_item,
    message_item,
    status_of,
    text_part,
    usage,
)  # fmt: skip
from tokenmill.server.streaming import Call, merged, sse


class Events:
    """Numbered events: every event of one response carries the next sequence number."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = sse({"type": kind, "sequence_number": self.sequence, **fields}, event=kind)
        self.sequence += 1
        return event


class Items:
    """Output items, and their events, from chat deltas (`{"content"?, "tool_calls"?}`, as `tools.ToolStream`
    gives them). Items are sent one after another: a new one closes the open one."""

    def __init__(self, emit: Events) -> None:
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.open = False  # whether the last item is still open
        self.calls: dict[int, int] = {}  # a chat delta's tool-call index -> its output index

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events = []
        if delta.get("content"):
            if not (self.open and self.items[-1]["type"] == "message"):
                events += self._add(message_item("", "in_progress"))
            part = self.items[-1]["content"][0]
            part["text"] += delta["content"]
            events.append(self._event("response.output_text.delta", content_index=0, delta=delta["content"],
                                      logprobs=[]))  # fmt: skip
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in self.calls:
                events += self._add(function_call_item(piece["id"], piece["function"]["name"], "", "in_progress"))
                self.calls[piece["index"]] = len(self.items) - 1
            arguments = piece["function"].get("arguments")
            if arguments:
                self.items[-1]["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta", delta=arguments))
        return events

    def finish(self, status: str) -> list[str]:
        """Close the last item with `status`; a model that wrote nothing gets an empty message, as a whole response
        has."""
        events = [] if self.items else self._add(message_item("", "in_progress"))
        return events + self._close(status)

    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self._close("completed")
        self.items.append(item)
        self.open = True
        events.append(self.emit("response.output_item.added", output_index=len(self.items) - 1,
                                item={**item, "content": []} if item["type"] == "message" else item))  # fmt: skip
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", content_index=0, part=text_part("")))
        return events

    def _close(self, status: str) -> list[str]:
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", content_index=0, part=part)]  # fmt: skip
        else:
            events = [self._event("response.function_call_arguments.done", name=item["name"],
                                  arguments=item["arguments"])]  # fmt: skip
        return events + [self.emit("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def _event(self, kind: str, **fields: Any) -> str:
        """An event about the last item."""
        return self.emit(kind, item_id=self.items[-1]["id"], output_index=len(self.items) - 1, **fields)


async def response_events(
    call: Call, plan: tools.ToolPlan, head: ResponseHead, on_done: Callable[[dict[str, Any]], None]
) -> AsyncIterator[str]:
    """The response's SSE; `on_done` gets the finished response object (to store it) before the last event."""
    emit = Events()
    started = head.body("in_progress", [], None)
    yield emit("response.created", response=started)
    yield emit("response.in_progress", response=started)
    text, items = tool_stream.ToolStream(plan), Items(emit)
    final: RequestOutput | None = None
    try:
        async for _, out in merged(call):
            c = out.outputs[0]
            for event in items.feed(text.feed(out.new_text[0], c.finish_reason is not None)):
                yield event
            if out.finished:
                final = out
                call.observe(out)
    except Exception as e:  # the request failed in the engine, or the engine died: say so in-band, then end
        for event in _failed(emit, head, items.items, f"generation failed: {e}"):
            yield event
        return
    if final is None or final.outputs[0].finish_reason == "abort":  # the server is shutting down (launch.py)
        for event in _failed(emit, head, items.items, ABORTED):
            yield event
        return
    status = status_of(final.outputs[0])
    for event in items.finish(status):
        yield event
    body = head.body(status, items.items, usage(len(call.prompts[0]), final))
    on_done(body)
    yield emit("response.completed", response=body)


def _failed(emit: Events, head: ResponseHead, output: list[dict[str, Any]], message: str) -> list[str]:
    return [emit("error", code="server_error", message=message, param=None),
            emit("response.failed", response=head.body("failed", output, None, error=message))]  # fmt: skip

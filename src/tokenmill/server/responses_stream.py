"""A streamed Responses API answer: OpenAI's typed server-sent events, each with its `sequence_number`, in the
order the `openai` SDK's `responses.stream()` assembles:

1. `response.created`, `response.in_progress` (the response with no output yet); a background response's
   `response.created` and `response.queued` say `queued`, and its `response.in_progress` comes with the engine's
   first output, as OpenAI's background streams go;
2. per output item, `response.output_item.added`, then
   - reasoning (with a reasoning parser, while the model thinks): `response.content_part.added` (a
     `reasoning_text` part), `response.reasoning_text.delta`s, `response.reasoning_text.done`,
     `response.content_part.done`;
   - a message: `response.content_part.added`, `response.output_text.delta`s, `response.output_text.done`,
     `response.content_part.done`;
   - a function call: `response.function_call_arguments.delta`s, `response.function_call_arguments.done`;
   then `response.output_item.done`;
3. `response.completed`, with the whole response. Its `status` is `incomplete` when max_output_tokens cut the
   output (as vLLM does: the SDK's `get_final_response` needs `response.completed`).
A failure mid-stream is an `error` event, then `response.failed`.

The text goes through the same `ChoiceStream` as a chat completion's (reasoning, then tool calls); `Items` turns
the chat deltas it gives into output items. A forced function streams its arguments as they are generated; tool
calls the model writes itself (`auto`) or that `required` constrains are read when the output is complete, each
sent whole then.

Must not import torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.outputs import RequestOutput
from tokenmill.server.choice_stream import AnswerPlan, ChoiceStream
from tokenmill.server.responses_output import (
    ABORTED,
    ResponseHead,
    function_call_item,
    message_item,
    reasoning_item,
    reasoning_part,
    status_of,
    text_part,
    usage,
)  # fmt: skip
from tokenmill.server.streaming import Call, merged, sse

# the items that hold one text part: how a new one starts, its empty part, and the prefix of its text events
_TEXT_ITEMS: dict[str, tuple[Callable[[str, str], dict[str, Any]], Callable[[str], dict[str, Any]], str]] = {
    "reasoning": (reasoning_item, reasoning_part, "response.reasoning_text"),
    "message": (message_item, text_part, "response.output_text"),
}


class Events:
    """Numbered events: every event of one response carries the next sequence number."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = sse({"type": kind, "sequence_number": self.sequence, **fields}, event=kind)
        self.sequence += 1
        return event


class Items:
    """Output items, and their events, from chat deltas (`{"reasoning_content"?, "content"?, "tool_calls"?}`, as
    `ChoiceStream` gives them). Items are sent one after another: a new one closes the open one."""

    def __init__(self, emit: Events) -> None:
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.open = False  # whether the last item is still open
        self.calls: dict[int, int] = {}  # a chat delta's tool-call index -> its output index

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            if delta.get(key):
                events += self._text(kind, delta[key])
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in self.calls:
                events += self._add(function_call_item(piece["id"], piece["function"]["name"], "", "in_progress"))
                self.calls[piece["index"]] = len(self.items) - 1
            arguments = piece["function"].get("arguments")
            if arguments:
                self.items[-1]["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta", delta=arguments))
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        """`text` added to the open item of `kind` (a new one if another is open)."""
        make, _, events_prefix = _TEXT_ITEMS[kind]
        events = [] if self.open and self.items[-1]["type"] == kind else self._add(make("", "in_progress"))
        self.items[-1]["content"][0]["text"] += text
        logprobs: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(f"{events_prefix}.delta", content_index=0, delta=text, **logprobs)]

    def finish(self, status: str) -> list[str]:
        """Close the last item with `status`; a model that wrote nothing gets an empty message, as a whole response
        has."""
        events = [] if self.items else self._add(message_item("", "in_progress"))
        return events + self._close(status)

    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self._close("completed")
        self.items.append(item)
        self.open = True
        text = item["type"] in _TEXT_ITEMS
        events.append(self.emit("response.output_item.added", output_index=len(self.items) - 1,
                                item={**item, "content": []} if text else item))  # fmt: skip
        if text:
            empty = _TEXT_ITEMS[item["type"]][1]("")
            events.append(self._event("response.content_part.added", content_index=0, part=empty))
        return events

    def _close(self, status: str) -> list[str]:
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = status
        if item["type"] in _TEXT_ITEMS:
            part = item["content"][0]
            logprobs: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            events = [self._event(f"{_TEXT_ITEMS[item['type']][2]}.done", content_index=0, text=part["text"],
                                  **logprobs),
                      self._event("response.content_part.done", content_index=0, part=part)]  # fmt: skip
        else:
            events = [self._event("response.function_call_arguments.done", name=item["name"],
                                  arguments=item["arguments"])]  # fmt: skip
        return events + [self.emit("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def _event(self, kind: str, **fields: Any) -> str:
        """An event about the last item."""
        return self.emit(kind, item_id=self.items[-1]["id"], output_index=len(self.items) - 1, **fields)


async def response_events(
    call: Call,
    answer: AnswerPlan,
    head: ResponseHead,
    on_done: Callable[[dict[str, Any]], None],
    on_first: Callable[[], None] | None = None,
    queued: bool = False,
) -> AsyncIterator[str]:
    """The response's SSE. `on_done` gets the last response object, finished or failed (to store it), before the last
    event; `on_first` is called when the engine's first output comes. `queued` (background): the response starts
    `queued` and goes `in_progress` with that output."""
    emit = Events()
    started = head.body("in_progress", [], None)
    if queued:
        waiting = head.body("queued", [], None)
        yield emit("response.created", response=waiting)
        yield emit("response.queued", response=waiting)
    else:
        yield emit("response.created", response=started)
        yield emit("response.in_progress", response=started)
    text, items = ChoiceStream(answer), Items(emit)
    final: RequestOutput | None = None
    first = True
    try:
        async for _, out in merged(call):
            if first:
                first = False
                if on_first is not None:
                    on_first()
                if queued:
                    yield emit("response.in_progress", response=started)
            c = out.outputs[0]
            for event in items.feed(text.feed(out.new_text[0], c.finish_reason is not None)):
                yield event
            if out.finished:
                final = out
                call.observe(out)
    except Exception as e:  # the request failed in the engine, or the engine died: say so in-band, then end
        for event in _failed(emit, head, items.items, f"generation failed: {e}", on_done):
            yield event
        return
    if final is None or final.outputs[0].finish_reason == "abort":  # the server is shutting down (launch.py)
        for event in _failed(emit, head, items.items, ABORTED, on_done):
            yield event
        return
    status = status_of(final.outputs[0])
    for event in items.finish(status):
        yield event
    body = head.body(status, items.items, usage(len(call.prompts[0]), final, answer))
    on_done(body)
    yield emit("response.completed", response=body)


def _failed(
    emit: Events, head: ResponseHead, output: list[dict[str, Any]], message: str,
    on_done: Callable[[dict[str, Any]], None],
) -> list[str]:  # fmt: skip
    body = head.body("failed", output, None, error=message)
    on_done(body)
    return [emit("error", code="server_error", message=message, param=None), emit("response.failed", response=body)]

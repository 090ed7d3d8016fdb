"""Background responses (`background: true`): the create call answers at once, with the response `queued`, and the
generation goes on in the server, as a task that writes the response into the store as it goes: `in_progress` once
the engine's first output comes, then the finished response (`completed` or `incomplete`, or `failed`).

`BackgroundRun.stop` ends a run early: it closes the engine request's stream, which aborts the request (its KV
blocks go back to the pool within a step), and cancels the task, so nothing is written after it. The cancel
endpoint stops a run that is still going; the store stops one when it drops or deletes its response
(responses_store.py), so no generation goes on for a response nobody can read.

With `stream: true` as well, the run keeps every event it sends (`events`): the create call streams them as they
come, and `GET /v1/responses/{id}?stream=true` streams them again, from the start or after `starting_after`, to the
end of the run, however often the client comes back. A streamed background response keeps its events as long as
the store keeps it.

Used from the event loop only (no lock). Must not import torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.engine.request_stream import RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.server.choice_stream import AnswerPlan
from tokenmill.server.responses_output import ABORTED, ResponseHead, response_body
from tokenmill.server.responses_stream import response_events
from tokenmill.server.streaming import Call, merged

Update = Callable[[dict[str, Any]], None]  # writes the response's current object into the store


class BackgroundRun:
    """One background response's generation."""

    def __init__(self, streamed: bool) -> None:
        self.events: list[str] | None = [] if streamed else None  # every SSE event so far, when streamed
        self.done = False
        self._streams: list[RequestStream] = []  # the engine request's, while the run goes on
        self._task: asyncio.Task[None] | None = None
        self._more = asyncio.Event()  # set when an event is added or the run ends (then replaced)

    def start(self, call: Call, answer: AnswerPlan, head: ResponseHead, update: Update) -> None:
        self._streams = call.streams
        self._task = asyncio.create_task(self._run(call, answer, head, update))

    def stop(self) -> None:
        """End the run now (a no-op once it has ended): abort the engine request, and write nothing more."""
        if self.done:
            return
        for stream in self._streams:
            stream.close()  # aborts the request, also when the task has not started yet
        if self._task is not None:
            self._task.cancel()
        self._end()

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The streamed events after sequence number `after` (-1: all), as they come, until the run ends."""
        assert self.events is not None, "only a streamed run keeps its events"
        at = after + 1
        while True:
            more = self._more  # taken before reading: an event added while we yield sets this one
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.done:
                return
            await more.wait()

    async def _run(self, call: Call, answer: AnswerPlan, head: ResponseHead, update: Update) -> None:
        def first() -> None:
            update(head.body("in_progress", [], None))

        if self.events is None:
            update(await _whole(call, answer, head, first))
        else:  # the last response is written (`update`) before the last event, and nothing awaits in between
            async for event in response_events(call, answer, head, update, first, queued=True):
                self.events.append(event)
                self._wake()
        self._end()

    def _end(self) -> None:
        self.done, self._streams = True, []
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()


async def _whole(call: Call, answer: AnswerPlan, head: ResponseHead, first: Callable[[], None]) -> dict[str, Any]:
    """The finished response, as a foreground one would be answered, or a failed one."""
    final: RequestOutput | None = None
    started = False
    try:
        async for _, out in merged(call):
            if not started:
                started = True
                first()
            if out.finished:
                final = out
                call.observe(out)
    except Exception as e:  # the request failed in the engine, or the engine died
        return head.body("failed", [], None, error=f"generation failed: {e}")
    if final is None or final.outputs[0].finish_reason == "abort":
        return head.body("failed", [], None, error=ABORTED)  # the server is shutting down (launch.py)
    return response_body(head, answer, len(call.prompts[0]), final)

"""One request's outputs as an async iterator (`RequestStream`), and the errors a stream can raise.

The engine that owns a stream (engine/async_engine.py) puts outputs on its queue from the loop thread; the stream
ends at a finished output, raises a failed request's error, and aborts its request if closed before the end.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from tokenmill.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected error; no request can be served any more."""


class RequestFailedError(RuntimeError):
    """A failure inside the engine ended this request; the engine serves the others on."""


class StreamOwner(Protocol):
    """What a stream asks of its engine when it closes."""

    def forget(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator. `close()` before the end aborts the request."""

    def __init__(self, engine: StreamOwner, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.error is not None:
            self.finished = True
            self.close()
            raise RequestFailedError(item.error)
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.forget(self.request_id)
            if not self.finished:
                self.engine.abort(self.request_id)

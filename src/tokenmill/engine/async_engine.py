"""The asynchronous engine: `EngineCore` runs in one background thread; asyncio callers get per-request streams.

Callers never touch the core directly. `generate()` validates in the caller (so a bad request fails at once)
and posts an "add" command; `abort()` posts an "abort" command. The loop thread applies commands between
steps, so an abort takes effect within one step and frees the request's blocks. Outputs travel back to each
request's asyncio queue with `call_soon_threadsafe`. If the loop dies, every open stream gets the error and
`is_healthy` turns false for good: a dead engine never looks healthy.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.loading import LoadedModel, load
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill.engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected error; no request can be served any more."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    tokenization_ms: float
    priority: int


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class RequestStream:
    """The outputs of one request, as an async iterator. `close()` before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
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
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine._forget(self.request_id)
            if not self.finished:
                self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, core: EngineCore, loaded: LoadedModel | None = None) -> None:
        self.core = core
        self.loaded = loaded  # the model's facts (tokenizer, dtype, device, defaults) for the server
        self.tokenizer = core.output.tokenizer
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()  # guards _streams between the caller threads and the loop thread
        self._thread: threading.Thread | None = None
        self.errored: BaseException | None = None

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        """Load the model `cfg` names and start the loop thread."""
        loaded = load(cfg)
        engine = cls(EngineCore.build(loaded, cfg), loaded)
        engine.start()
        return engine

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(_Stop())
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self.errored is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue a request; iterate the returned stream for its outputs (one per step that produced any).

        Raises ValueError at once for a request that can never run. Closing the stream early aborts it.
        """
        if self.errored is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.errored!r}")
        arrival = arrival_time or time.perf_counter()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        tokenization_ms = (time.perf_counter() - arrival) * 1000 if text is not None else 0.0
        self.core.validate(token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, request_id)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        self._commands.put(_Add(request_id, token_ids, params, text, arrival, tokenization_ms, priority))
        return stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """`add_request` as an async generator (validation happens on the first iteration)."""
        stream = self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        """Requests not yet computing: waiting in the scheduler or not yet picked up by the loop."""
        return len(self.core.scheduler.waiting) + self._commands.qsize()

    def abort(self, request_id: str) -> None:
        """Stop a request within one step; its stream ends with finish_reason "abort"."""
        self._commands.put(_Abort(request_id))

    # -- the loop thread ----------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _apply(self, cmd: _Command) -> bool:
        """Apply one command; False means stop the loop."""
        if isinstance(cmd, _Stop):
            return False
        if isinstance(cmd, _Abort):
            final = self.core.abort(cmd.request_id)
            if final is not None:
                self._deliver(cmd.request_id, final)
            return True
        try:
            self.core.add_request(
                cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.prompt, cmd.arrival_time,
                cmd.tokenization_ms, cmd.priority,
            )  # fmt: skip
        except ValueError as e:  # raced validation (e.g. duplicate id): fail just this request
            self._deliver(cmd.request_id, e)
        return True

    def _loop(self) -> None:
        try:
            while True:
                idle = not self.core.has_unfinished()
                try:
                    cmd = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if not self._apply(cmd):
                        return
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self.core.has_unfinished():
                    for out in self.core.step():
                        self._deliver(out.request_id, out)
        except BaseException as e:  # the engine is dead: tell everyone waiting, never hang them
            log.exception("engine loop died")
            self.errored = e
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, EngineDeadError(f"the engine loop has stopped: {e!r}"))

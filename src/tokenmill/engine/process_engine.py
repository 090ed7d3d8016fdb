"""`ProcessEngine`: the server's engine when the engine runs in a process of its own (`tokenmill serve`'s default).

Why: torch's import and the model's load take most of a start, and they hold the interpreter's lock, as do the
server's imports and the tokenizer's build. In two processes they run at once, so the server is ready when the
slower of the two is (docs/benchmarks.md, "Start to healthy"). The server's process never imports torch.

`EngineProcess` (engine/process_start.py) starts `python -m tokenmill.server.engine_process` at once, before the
server's own imports, and hands it the engine's config over a socket pair. `ProcessEngine` then stands where the
server expects an `AsyncEngine`, with the same methods. The server's side:
- tokenizes and validates each request itself, from facts the engine sent once loaded (`EngineFacts`), so a bad
  request fails at once, as in one process;
- sends requests, aborts and calls (a grammar's compile, LoRA loads) down the socket;
- reads the engine's messages on one thread: per step, the engine's numbers and then that step's outputs, each as
  what it adds (output_codec.py), which it rebuilds and puts on each request's stream.
If the engine's process ends without being asked to (its loop died, or it was killed), every open stream and call
gets the error, `is_healthy` turns false, and `on_death` is called: the server exits 1, as for a dead loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from itertools import count
from pathlib import Path
from typing import Any

from tokenmill.engine.output_codec import OutputDecoder
from tokenmill.engine.process_start import EngineFacts, EngineProcess, load_tokenizer
from tokenmill.engine.request_stream import EngineDeadError, RequestStream
from tokenmill.engine.request_text import RequestText
from tokenmill.engine.validation import check_adapter, check_generates, check_pooling, output_budget
from tokenmill.metrics import EngineSnapshot
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer
from tokenmill.types import EngineRequest

log = logging.getLogger("tokenmill.engine")
_NO_SAMPLING = SamplingParams(max_tokens=None)


def connect(process: EngineProcess, path: Path) -> ProcessEngine:
    """The server's side of the engine `process` is loading: the tokenizer built here meanwhile, then the engine's
    facts once it is ready. ValueError with one line where either fails (the engine's own line first)."""
    from tokenmill.memory import trim

    try:
        tokenizer, error = load_tokenizer(path), None
        trim()  # what building it parsed and freed goes back to the system (memory.py)
    except Exception as e:  # the engine meets the same file: its line says it best, so wait for it
        tokenizer, error = None, e
    # what the engine reads of the tokenizer while it loads (else it builds its own: it fails as ours did)
    with contextlib.suppress(OSError):  # (it failed already: wait_ready reads its line)
        process.link.send(("tokenizer", tokenizer is not None, None if tokenizer is None else tokenizer.eos_token_id))
    facts = process.wait_ready()
    if tokenizer is None:
        raise ValueError(str(error)) from None
    return ProcessEngine(process, facts, tokenizer)


@dataclass
class _Target:
    """Where one request's outputs go, and what rebuilds them."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    decoder: OutputDecoder
    text: RequestText | None  # None: a pooling request (no text)


class ProcessEngine:
    def __init__(self, process: EngineProcess, facts: EngineFacts, tokenizer: Tokenizer) -> None:
        self.process, self.facts, self.tokenizer = process, facts, tokenizer
        self.max_model_len, self.vocab_size, self.task = facts.max_model_len, facts.vocab_size, facts.task
        self.description, self.memory_bytes = facts.description, facts.memory_bytes
        self._adapters = facts.adapters
        self._lock = threading.Lock()  # guards what the reader thread and the callers share below
        self._streams: dict[str, _Target] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = count()
        self._snapshot = EngineSnapshot()
        self._posted = 0  # sequences sent to the engine
        self._applied = 0  # of which its published snapshot counts
        self._stopping = False
        self.errored: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._reader = threading.Thread(target=self._read, name="tokenmill-engine-link", daemon=True)
        self._reader.start()

    # -- lifecycle ----------------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.errored is None and not self._stopping and self.process.proc.poll() is None

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.process.stop(timeout)
        self._reader.join(timeout)

    # -- facts and numbers --------------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        return self.facts.defaults

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, lora: str | None = None) -> int:
        """As `AsyncEngine.validate`, from the engine's facts."""
        check_adapter(lora, None if self._adapters is None else (name for name, _ in self._adapters))
        check_generates(self.task)
        return output_budget(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.facts)

    def validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        f = self.facts
        check_pooling(prompt_token_ids, params, self.task, f.hidden_size, self.vocab_size, self.max_model_len, f)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """Compiled in the engine's process, where it is kept for the request (ValueError if bad); the server runs
        this off its event loop, as in one process. Returns None: the engine finds its compiled grammar there."""
        if params.structured_outputs is not None:
            self._call("compile", params).result()
        return None

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            pending = self._posted - self._applied
            return replace(self._snapshot, waiting=self._snapshot.waiting + pending) if pending else self._snapshot

    @property
    def num_open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def num_pending(self) -> int:
        return self.snapshot().waiting

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None, tokenization_ms: float = 0.0,
                    lora: str | None = None) -> RequestStream:  # fmt: skip
        """As `AsyncEngine.add_request` (a text prompt is tokenized here)."""
        self._check_alive()
        arrival = arrival_time or time.perf_counter()
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
            tokenization_ms = (time.perf_counter() - arrival) * 1000
        else:
            text, token_ids = None, list(prompt)
        max_tokens = self.validate(token_ids, params, lora)
        self.compile_grammar(params)
        request = EngineRequest(request_id or uuid.uuid4().hex, token_ids, params, max_tokens, text, arrival,
                                tokenization_ms, priority, lora=lora)  # fmt: skip
        return self._post([request])[0]

    def add_requests(
        self, prompts: list[list[int]], params: SamplingParams, request_ids: list[str], priority: int = 0,
        grammar: Any = None, lora: str | None = None,
    ) -> list[RequestStream]:  # fmt: skip
        """As `AsyncEngine.add_requests`; `grammar` is not sent (the engine keeps its own compiled copy)."""
        self._check_alive()
        arrival = time.perf_counter()
        requests = [EngineRequest(rid, ids, params, self.validate(ids, params, lora), None, arrival, 0.0, priority,
                                  lora=lora) for rid, ids in zip(request_ids, prompts, strict=True)]  # fmt: skip
        return self._post(requests)

    def add_pooling_requests(self, prompts: list[list[int]], params: PoolingParams, request_ids: list[str],
                             priority: int = 0) -> list[RequestStream]:  # fmt: skip
        self._check_alive()
        arrival = time.perf_counter()
        for ids in prompts:
            self.validate_pooling(ids, params)
        requests = [EngineRequest(rid, ids, _NO_SAMPLING, 0, None, arrival, 0.0, priority, pooling=params)
                    for rid, ids in zip(request_ids, prompts, strict=True)]  # fmt: skip
        return self._post(requests)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:  # fmt: skip
        stream = self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _post(self, requests: list[EngineRequest]) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, r.request_id) for r in requests]
        with self._lock:
            taken = [r.request_id for r in requests if r.request_id in self._streams]
            if taken or len({r.request_id for r in requests}) < len(requests):
                raise ValueError(f"request id {(taken or [requests[0].request_id])[0]!r} is already in use")
            for r, stream in zip(requests, streams, strict=True):
                decoder = OutputDecoder(r.request_id, r.prompt, r.prompt_token_ids)
                text = (
                    None
                    if r.pooling is not None
                    else RequestText(
                        self.tokenizer,
                        r.prompt_token_ids,
                        r.params,
                        functools.partial(self._stop_sequence, r.request_id),
                    )
                )
                self._streams[r.request_id] = _Target(loop, stream.queue, decoder, text)
            self._posted += sum(r.params.n for r in requests)
        self._send(("add", requests))
        return streams

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _stop_sequence(self, request_id: str, index: int, num_tokens: int, stop: str) -> None:
        self._send(("stop_seq", request_id, index, num_tokens, stop))

    def abort_all(self) -> None:
        self._send(("abort_all",))

    # -- LoRA adapters ------------------------------------------------------------------------------------
    def lora_adapters(self) -> list[tuple[str, str]]:
        return list(self._adapters or ())

    async def load_lora(self, name: str, path: str) -> None:
        self._adapters = await asyncio.wrap_future(self._call("load_lora", name, path))

    async def unload_lora(self, name: str) -> None:
        self._adapters = await asyncio.wrap_future(self._call("unload_lora", name))

    # -- the link -----------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.errored}")

    def _send(self, message: Any) -> None:
        with contextlib.suppress(OSError):  # the engine's process has gone: the reader thread tells everyone
            self.process.link.send(message)

    def _call(self, kind: str, *args: Any) -> concurrent.futures.Future[Any]:
        """Run `kind` in the engine's process; its result (or error) comes back on the future."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._check_alive()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = done
        self._send(("call", call_id, kind, args))
        return done

    def _read(self) -> None:
        """The reader thread: every message from the engine's process, in order, until it ends."""
        try:
            while True:
                message = self.process.link.recv()
                if message[0] == "out":
                    self._outputs(*message[1:])
                elif message[0] == "reply":
                    self._reply(*message[1:])
                elif message[0] == "died":
                    self._died(EngineDeadError(f"the engine loop has stopped: {message[1]}"))
        except (EOFError, OSError):
            if not self._stopping:
                status = self.process.proc.wait()
                self._died(EngineDeadError(f"the engine's process exited with status {status}"))

    def _outputs(self, snapshot: EngineSnapshot, applied: int, items: list[tuple[str, Any, Any]]) -> None:
        """The numbers first, then the outputs: a client that has its response reads numbers that count it."""
        with self._lock:
            self._snapshot, self._applied = snapshot, applied
        for request_id, encoded, error in items:
            with self._lock:
                target = self._streams.get(request_id)
            if target is None:
                continue
            item = error
            if error is None:
                item = target.decoder.decode(encoded)
                item = item if target.text is None else target.text.apply(item)
            target.loop.call_soon_threadsafe(target.queue.put_nowait, item)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            done = self._calls.pop(call_id, None)
        if done is not None:
            done.set_result(value) if ok else done.set_exception(value)

    def _died(self, error: BaseException) -> None:
        if self.errored is not None:
            return
        log.error("%s", error)
        self.errored = error
        if self.on_death is not None:
            self.on_death(error)  # before the streams hear it: whoever reads a dead stream sees a dead engine
        with self._lock:
            streams, calls = list(self._streams.values()), list(self._calls.values())
            self._calls.clear()
        for target in streams:
            target.loop.call_soon_threadsafe(target.queue.put_nowait, error)
        for done in calls:
            done.set_exception(error)

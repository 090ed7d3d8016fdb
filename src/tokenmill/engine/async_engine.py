"""The asynchronous engine: `EngineCore` runs in one background thread; asyncio callers get per-request streams.

This is the server's only door to the engine; callers never touch the core. `add_request` validates once, in
the caller (so a bad request fails at once), and posts an "add" command; `abort()` posts an "abort" command.
The loop thread applies commands between steps, so an abort takes effect within one step and frees the
request's blocks. Outputs travel back to each request's asyncio queue with `call_soon_threadsafe`.

Other threads read the engine's numbers only through `snapshot()`: a frozen object the loop thread
publishes after every step, before that step's outputs go out (so a client that has its response reads numbers
that count it). If the loop dies, every open stream gets the error and `is_healthy` turns false
for good: a dead engine never looks healthy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenmill.engine.commands import Abort, AbortAll, Add, Call, Command, Stop, StopSequence
from tokenmill.engine.footprint import memory_line, model_bytes
from tokenmill.engine.request_stream import EngineDeadError, RequestStream
from tokenmill.metrics import EngineSnapshot
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import ModelTask, PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer
from tokenmill.types import EngineRequest

if TYPE_CHECKING:  # NOTE: the core pulls in torch; this module stays importable without it (the server's door)
    from tokenmill.assembly.model import LoadedModel
    from tokenmill.config import EngineConfig
    from tokenmill.engine.core import EngineCore

log = logging.getLogger("tokenmill.engine")


_NO_SAMPLING = SamplingParams(max_tokens=None)  # a pooling request's sampling parameters: it samples nothing


class AsyncEngine:
    def __init__(self, core: EngineCore, model: LoadedModel) -> None:
        self.core = core  # driven by the loop thread alone once started
        self.tokenizer: Tokenizer = model.tokenizer
        self.max_model_len: int = core.max_model_len
        self.vocab_size: int = core.vocab_size
        self.task: ModelTask = core.task  # what it serves: generation and/or pooling requests
        self._defaults = model.default_sampling_params()
        kv = core.kv
        capacity = f"{kv.num_blocks * kv.block_size} tokens ({kv.num_blocks} blocks)" if kv.num_blocks else "unpaged"
        weights, pool = model_bytes(model, core)
        self.memory_bytes = weights + pool  # what a server's memory budget counts for this model (weights + KV pool)
        self.description = (
            f"{model.dtype} on {model.device}, KV capacity {capacity}, max_model_len {self.max_model_len}; "
            f"{memory_line(weights, pool)}"
        )
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()  # guards _streams, _snapshot and the pending counts across threads
        self._snapshot = core.snapshot()
        self._pending_seqs = 0  # sequences of adds posted but not yet counted in a published snapshot
        self._outbox: list[tuple[str, Any]] = []  # (request id, output or error) for after the next publish
        self._applied_seqs = 0  # loop thread: sequences added to the core since the last publish
        self._thread: threading.Thread | None = None
        self.errored: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None  # called on the loop thread as it dies

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        """Load the model `cfg` names and start the loop thread."""
        from tokenmill.assembly import load
        from tokenmill.engine.build import build_engine_core

        loaded = load(cfg)
        engine = cls(build_engine_core(loaded, cfg), loaded)
        engine.start()
        return engine

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(Stop())
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.core.close()

    @property
    def is_healthy(self) -> bool:
        alive = self.errored is None and self._thread is not None and self._thread.is_alive()
        return alive and self.core.runner.alive  # a tensor-parallel worker that died ends serving too

    # -- facts and numbers --------------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults."""
        return self._defaults

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, lora: str | None = None) -> int:
        """Raise ValueError for a request that can never run (LoraError for an adapter `lora` not loaded); return
        its output budget (max_tokens)."""
        return self.core.validate(prompt_token_ids, params, lora)

    def validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        """Raise ValueError for a pooling request this model cannot serve or that can never run."""
        self.core.validate_pooling(prompt_token_ids, params)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The request's grammar (structured_outputs) compiled, or None without one. Cached by its text; the first
        compile of a schema can take a second, so a server calls this off its event loop. ValueError if bad."""
        return None if params.structured_outputs is None else self.core.structured.compile(params.structured_outputs)

    def snapshot(self) -> EngineSnapshot:
        """The engine's numbers as of the last step (published by the loop thread). `waiting` also counts
        the sequences of requests posted but not yet picked up by the loop."""
        with self._lock:
            if not self._pending_seqs:
                return self._snapshot
            return replace(self._snapshot, waiting=self._snapshot.waiting + self._pending_seqs)

    @property
    def num_open_streams(self) -> int:
        """Requests whose streams are still open (running, waiting, or not yet picked up by the loop)."""
        with self._lock:
            return len(self._streams)

    @property
    def num_pending(self) -> int:
        """Sequences not yet computing: waiting in the scheduler or not yet picked up by the loop."""
        return self.snapshot().waiting

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tokenization_ms: float = 0.0,
        lora: str | None = None,
    ) -> RequestStream:
        """Queue a request; iterate the returned stream for its outputs (one per step that produced any).

        A text prompt is tokenized here, in the caller's thread; a server passes token ids (and how long
        tokenizing them took) so its event loop never waits on it. Raises ValueError at once for a request
        that can never run. Closing the stream early aborts it.
        """
        self._check_alive()
        arrival = arrival_time or time.perf_counter()
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
            tokenization_ms = (time.perf_counter() - arrival) * 1000
        else:
            text, token_ids = None, list(prompt)
        request_id = request_id or uuid.uuid4().hex
        max_tokens = self.validate(token_ids, params, lora)
        grammar = self.compile_grammar(params)
        request = EngineRequest(request_id, token_ids, params, max_tokens, text, arrival, tokenization_ms, priority,
                                grammar, lora=lora)  # fmt: skip
        return self._post([request])[0]

    def add_requests(
        self, prompts: list[list[int]], params: SamplingParams, request_ids: list[str], priority: int = 0,
        grammar: Any = None, lora: str | None = None,
    ) -> list[RequestStream]:  # fmt: skip
        """Several prompts with the same parameters, all or none: every one is validated before any starts.
        `grammar`: `compile_grammar(params)`, already compiled off the event loop (else the engine compiles it);
        `lora`: the LoRA adapter they run with (None: the base model)."""
        self._check_alive()
        arrival = time.perf_counter()
        requests = [EngineRequest(rid, ids, params, self.validate(ids, params, lora), None, arrival, 0.0, priority,
                                  grammar, lora=lora)
                    for rid, ids in zip(request_ids, prompts, strict=True)]  # fmt: skip
        return self._post(requests)

    def add_pooling_requests(
        self, prompts: list[list[int]], params: PoolingParams, request_ids: list[str], priority: int = 0
    ) -> list[RequestStream]:
        """Pooling requests (embeddings or scores), all or none: every one is validated before any starts. Each
        stream gives one output, at the end, with its `pooled` result."""
        self._check_alive()
        arrival = time.perf_counter()
        for ids in prompts:
            self.validate_pooling(ids, params)
        requests = [EngineRequest(rid, ids, _NO_SAMPLING, 0, None, arrival, 0.0, priority, pooling=params)
                    for rid, ids in zip(request_ids, prompts, strict=True)]  # fmt: skip
        return self._post(requests)

    # -- LoRA adapters ------------------------------------------------------------------------------------
    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of each LoRA adapter served, in load order (none where the engine serves no adapters)."""
        registry = self.core.lora
        return [] if registry is None else [(a.name, a.path) for a in registry.loaded]

    async def load_lora(self, name: str, path: str) -> None:
        """Read and check the adapter in `path` off the loop thread, then install it between steps. LoraError: no
        adapters served, a bad folder, an adapter that does not fit the model, or a name already taken."""
        registry = self._registry()
        adapter = await asyncio.to_thread(registry.read, name, path)
        await self._call(lambda: registry.add(adapter))

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter between steps. LoraError 404: unknown; 409: unfinished requests run with it."""
        registry = self._registry()
        registry.check_unload(name)  # at once, even while a step runs
        await self._call(lambda: registry.remove(name))

    def _registry(self) -> Any:
        self._check_alive()
        if self.core.lora is None:
            from tokenmill.errors import LoraError

            raise LoraError("this engine serves no LoRA adapters: start it with --enable-lora or --lora-modules")
        return self.core.lora

    async def _call(self, fn: Callable[[], Any]) -> Any:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(Call(fn, done))
        return await asyncio.wrap_future(done)

    def _check_alive(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.errored!r}")

    def _post(self, requests: list[EngineRequest]) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, r.request_id) for r in requests]
        with self._lock:
            taken = [r.request_id for r in requests if r.request_id in self._streams]
            if taken or len({r.request_id for r in requests}) < len(requests):
                raise ValueError(f"request id {(taken or [requests[0].request_id])[0]!r} is already in use")
            for stream in streams:
                self._streams[stream.request_id] = (loop, stream.queue)
        self.post_requests(requests)
        return streams

    def post_requests(self, requests: list[EngineRequest]) -> None:
        """Queue validated requests for the loop thread; their outputs go where `_flush` sends them (a stream each,
        or the server's process: server/engine_process.py)."""
        with self._lock:
            self._pending_seqs += sum(r.params.n for r in requests)
        for r in requests:
            self._commands.put(Add(r))

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

    def forget(self, request_id: str) -> None:
        """Drop `request_id`'s stream (its own `close`): no output goes to it any more."""
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request within one step; its stream ends with finish_reason "abort"."""
        self._commands.put(Abort(request_id))
        self.core.runner.hooks.release()  # a test's held step goes on, and the abort finds its request unfinished

    def stop_sequence(self, parent_id: str, index: int, num_tokens: int, stop: str) -> None:
        """A stop string the server found ends that sample within one step (`EngineCore.stop_sequence`)."""
        self._commands.put(StopSequence(parent_id, index, num_tokens, stop))

    def abort_all(self) -> None:
        """Stop every request within one step (a server whose shutdown grace period runs out)."""
        self._commands.put(AbortAll())
        self.core.runner.hooks.release()

    # -- the loop thread ----------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: Any) -> None:
        """Send `item` to the request's stream once the snapshot that counts it is published (`_flush`): a client
        that reads the server's numbers right after its response then sees its request finished, not running."""
        self._outbox.append((request_id, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for request_id, item in outbox:
            self._send(request_id, item)

    def _send(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _publish(self) -> None:
        snapshot = self.core.snapshot()
        with self._lock:
            self._snapshot = snapshot
            self._pending_seqs -= self._applied_seqs
            self._applied_seqs = 0

    def _apply(self, cmd: Command) -> bool:
        """Apply one command; False means stop the loop."""
        if isinstance(cmd, Stop):
            return False
        if isinstance(cmd, Call):
            try:
                cmd.done.set_result(cmd.fn())
            except Exception as e:  # (the caller's error: the engine goes on)
                cmd.done.set_exception(e)
            return True
        if isinstance(cmd, StopSequence):
            for out in self.core.stop_sequence(cmd.parent_id, cmd.index, cmd.num_tokens, cmd.stop):
                self._deliver(out.request_id, out)
            return True
        if isinstance(cmd, Abort | AbortAll):
            for request_id in [cmd.request_id] if isinstance(cmd, Abort) else list(self.core.requests):
                final = self.core.abort(request_id)
                if final is not None:
                    self._deliver(request_id, final)
            return True
        self._applied_seqs += cmd.request.params.n
        try:
            self.core.add_request(cmd.request)
        except ValueError as e:  # raced (e.g. a duplicate id): fail just this request
            self._deliver(cmd.request.request_id, e)
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
                        self._publish()
                        self._flush()  # (what the commands before the stop sent)
                        return
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                busy = self.core.has_unfinished()
                if busy:
                    for out in self.core.step():
                        self._deliver(out.request_id, out)
                self._publish()
                self._flush()
                if busy and not self.core.has_unfinished():  # just gone idle (after the outputs are out)
                    self.core.idle()
                if not self.core.runner.alive:  # checked idle too: a dead tensor-parallel rank ends the engine
                    raise RuntimeError("a tensor-parallel worker process exited")
        except BaseException as e:  # the engine is dead: tell everyone waiting, never hang them
            log.exception("engine loop died")
            self.errored = e
            if self.on_death is not None:
                self.on_death(e)  # before the streams hear it: whoever reads a dead stream sees a dead engine
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._send(request_id, EngineDeadError(f"the engine loop has stopped: {e!r}"))
            self._fail_calls(EngineDeadError(f"the engine loop has stopped: {e!r}"))

    def _fail_calls(self, error: BaseException) -> None:
        """The loop is gone: the calls still queued get `error` instead of waiting forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Call):
                cmd.done.set_exception(error)

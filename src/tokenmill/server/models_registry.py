"""The models one server serves, and which of them are loaded: a model loads when a request first asks for it;
past `--max-loaded-models` or `--models-memory-gb` the least recently used idle one is unloaded first; one idle
for `--idle-unload-seconds` is unloaded.

The registry is the one owner of every model's state, changed only on the server's event loop (a load or an unload
runs on a worker thread, and its result is applied back on the loop). A route gets its engine through `lease(name)`,
which holds the model for the request: a model with a lease, open streams, or running or waiting requests is busy,
and a busy model is never unloaded. Two requests for a model that is not loaded wait on the same load.

With one model given as `tokenmill serve MODEL` (`keep_loaded`), that model loads at start and stays, as the
server always did: until it is ready a request gets 503 at once, and a dead engine is not replaced.

Must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.footprint import return_memory
from tokenmill.metrics import EngineSnapshot, PrometheusMetrics
from tokenmill.server.errors import APIError

LOADED, LOADING, UNLOADED = "loaded", "loading", "unloaded"
GB = 2**30
RETRY = {"Retry-After": "5"}
log = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what requests put in `model`
    load: Callable[[], AsyncEngine]  # builds the engine, on a worker thread; raises if it cannot
    estimated_bytes: int = 0  # its weights and KV pool, judged before a first load (assembly/estimate.py)


@dataclass(frozen=True)
class Limits:
    max_loaded: int | None = None  # models loaded at once (None: no limit)
    memory_bytes: int | None = None  # their weights and KV pools together (None: no limit)
    idle_unload_s: float | None = None  # a model idle this long is unloaded (None: never)
    load_wait_s: float = 600.0  # how long a request waits for its model to load before a 503


@dataclass
class _Slot:
    spec: ModelSpec
    bytes: int  # the engine's own count once it has loaded, else the estimate
    engine: AsyncEngine | None = None
    loading: asyncio.Task[AsyncEngine] | None = None
    admitted: bool = False  # counted against the limits: loaded, or let in to load
    leases: int = 0  # requests holding it (waiting for it included)
    last_used: float = 0.0  # time.monotonic() of its last use
    max_model_len: int | None = None  # from its last load
    error: str | None = None  # why its last load failed, until one succeeds


class ModelRegistry:
    def __init__(self, specs: list[ModelSpec], limits: Limits, keep_loaded: bool = False) -> None:
        self._slots = {s.name: _Slot(s, s.estimated_bytes) for s in specs}
        self.names = list(self._slots)
        self.limits, self.keep_loaded = limits, keep_loaded
        self.metrics: PrometheusMetrics | None = None  # set by the app; loads and unloads are counted there
        self.on_loaded: Callable[[str, AsyncEngine], None] | None = None  # the app's hook, after each load
        self._room = asyncio.Lock()  # one admission (and its unloads) at a time
        self._tasks: list[asyncio.Task[Any]] = []

    # -- lifecycle (the app's lifespan) -------------------------------------------------------------------
    def start(self) -> None:
        """On the event loop: the one model of `keep_loaded` starts loading; the idle unloader starts."""
        if self.keep_loaded:
            for slot in self._slots.values():
                slot.loading = asyncio.create_task(self._load(slot))
                slot.loading.add_done_callback(lambda t: t.cancelled() or t.exception())  # (its error is kept)
        if self.limits.idle_unload_s is not None:
            self._tasks.append(asyncio.create_task(self._unload_idle(self.limits.idle_unload_s)))

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for engine in self.engines():
            engine.shutdown()

    # -- what the routes read -----------------------------------------------------------------------------
    def engines(self) -> list[AsyncEngine]:
        return [s.engine for s in self._slots.values() if s.engine is not None]

    def engine(self, name: str) -> AsyncEngine | None:
        """`name`'s engine if it is loaded (nothing is loaded for this)."""
        return self._slots[name].engine

    def status(self, name: str) -> str:
        """loaded, loading or unloaded (a dead engine, which its next request replaces, counts as unloaded)."""
        slot = self._slots[name]
        if slot.engine is not None and slot.engine.is_healthy:
            return LOADED
        return LOADING if slot.loading is not None else UNLOADED

    def states(self) -> dict[str, str]:
        return {name: self.status(name) for name in self.names}

    def snapshots(self) -> dict[str, EngineSnapshot]:
        return {s.spec.name: s.engine.snapshot() for s in self._slots.values() if s.engine is not None}

    def card(self, name: str) -> dict[str, Any]:
        """What /v1/models adds to OpenAI's fields for `name`: its state, its last load's error, its length."""
        slot = self._slots[name]
        extra: dict[str, Any] = {"status": self.status(name)}
        if slot.max_model_len is not None:
            extra["max_model_len"] = slot.max_model_len
        if slot.error is not None:
            extra["error"] = slot.error
        return extra

    def name_of(self, engine: AsyncEngine) -> str | None:
        return next((s.spec.name for s in self._slots.values() if s.engine is engine), None)

    # -- a request's engine -------------------------------------------------------------------------------
    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[AsyncEngine]:
        """`name`'s engine, loaded first if need be (a bounded wait), held loaded until the block ends."""
        slot = self._slots[name]
        slot.leases += 1
        try:
            yield await self._ready(slot)
        finally:
            slot.leases -= 1
            slot.last_used = time.monotonic()

    async def _ready(self, slot: _Slot) -> AsyncEngine:
        engine, name = slot.engine, slot.spec.name
        if engine is not None and engine.is_healthy:
            fleet = getattr(engine, "replica_states", None)  # data parallel: replicas may be restarting
            if fleet is not None and not any(s.serving for s in fleet().values()):
                raise APIError(503, "no engine replica is serving (they are restarting); retry shortly",
                               headers=RETRY)  # fmt: skip
            slot.last_used = time.monotonic()
            return engine
        if self.keep_loaded:
            if engine is not None:
                raise APIError(503, "the engine has stopped; the server must be restarted")
            raise APIError(503, "the model is still loading; retry shortly", headers=RETRY)
        if engine is not None:  # its loop died (the error went to its requests): free it, load it anew
            await self._unload(slot, "its engine stopped")
        if slot.loading is None:
            slot.loading = asyncio.create_task(self._load(slot))
        wait = self.limits.load_wait_s
        try:  # (shielded: a request that gives up does not cancel the load the others wait for)
            return await asyncio.wait_for(asyncio.shield(slot.loading), wait)
        except TimeoutError:
            raise APIError(503, f"the model {name!r} is still loading after {wait:g} s (--model-load-timeout); retry "
                           "shortly", param="model", code="model_loading", headers=RETRY) from None  # fmt: skip

    # -- loading and unloading ----------------------------------------------------------------------------
    async def _load(self, slot: _Slot) -> AsyncEngine:
        name = slot.spec.name
        try:
            async with self._room:
                await self._make_room(slot)
                slot.admitted = True
            started = time.monotonic()
            log.info("loading model %s", name)
            try:
                engine = await asyncio.get_running_loop().run_in_executor(None, slot.spec.load)
            except Exception as e:
                slot.admitted, slot.error = False, (f"{type(e).__name__}: {e}".splitlines() or ["failed"])[0]
                log.error("loading model %s failed: %s", name, slot.error)
                raise APIError(503, f"the model {name!r} failed to load: {slot.error}", param="model",
                               code="model_load_failed") from None  # fmt: skip
            slot.engine, slot.error, slot.last_used = engine, None, time.monotonic()
            slot.bytes = getattr(engine, "memory_bytes", 0) or slot.bytes
            slot.max_model_len = engine.max_model_len
            if self.on_loaded is not None:
                self.on_loaded(name, engine)
            if self.metrics is not None:
                self.metrics.observe_load(name, time.monotonic() - started)
            log.info("model %s loaded in %.1f s (%.2f GB)", name, time.monotonic() - started, slot.bytes / GB)
            return engine
        finally:
            slot.loading = None

    async def _make_room(self, slot: _Slot) -> None:
        """Unload least recently used idle models until `slot` fits the limits; 503 when only busy ones are left."""
        name, budget = slot.spec.name, self.limits.memory_bytes
        if budget is not None and slot.bytes > budget:
            raise APIError(503, f"the model {name!r} needs about {slot.bytes / GB:.2f} GB, more than the whole "
                           f"memory budget (--models-memory-gb={budget / GB:g})", param="model",
                           code="model_over_budget")  # fmt: skip
        while (limit := self._over(slot)) is not None:
            idle = [s for s in self._slots.values() if s is not slot and s.engine is not None and not self._busy(s)]
            if not idle:
                raise APIError(503, f"loading the model {name!r} would exceed {limit}, and every loaded model is "
                               "busy; retry shortly", param="model", code="model_budget_exceeded",
                               headers=RETRY)  # fmt: skip
            await self._unload(min(idle, key=lambda s: s.last_used), f"making room for {name}")

    def _over(self, slot: _Slot) -> str | None:
        """Which limit loading `slot` beside the admitted models would break, in words; None if none."""
        others = [s for s in self._slots.values() if s.admitted and s is not slot]
        limit, budget = self.limits.max_loaded, self.limits.memory_bytes
        if limit is not None and len(others) >= limit:
            return f"--max-loaded-models={limit}"
        held = sum(s.bytes for s in others)
        if budget is not None and held + slot.bytes > budget:
            return (f"the memory budget (--models-memory-gb={budget / GB:g}: {held / GB:.2f} GB held, "
                    f"{slot.bytes / GB:.2f} GB more needed)")  # fmt: skip
        return None

    def _busy(self, slot: _Slot) -> bool:
        engine = slot.engine
        if slot.leases or engine is None:
            return bool(slot.leases)
        snap = engine.snapshot()
        return engine.num_open_streams > 0 or snap.running > 0 or snap.waiting > 0

    async def _unload(self, slot: _Slot, why: str) -> None:
        """Stop the engine's loop and let its weights and KV pool go (then the allocator gives the pages back)."""
        engine, slot.engine, slot.admitted = slot.engine, None, False
        if engine is None:
            return
        log.info("unloading model %s (%s)", slot.spec.name, why)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, engine.shutdown)
        del engine  # the last reference: the collection below frees its tensors
        await loop.run_in_executor(None, return_memory)
        if self.metrics is not None:
            self.metrics.observe_unload(slot.spec.name)

    async def _unload_idle(self, idle_s: float) -> None:
        while True:
            await asyncio.sleep(min(1.0, idle_s / 4))
            try:
                await self._unload_idle_now(idle_s)
            except Exception:  # (one failed unload must not end the unloader)
                log.exception("unloading idle models failed")

    async def _unload_idle_now(self, idle_s: float) -> None:
        now = time.monotonic()
        for slot in self._slots.values():
            if slot.engine is None:
                continue
            if self._busy(slot):
                slot.last_used = now  # idle time counts from when it was last seen busy
            elif now - slot.last_used >= idle_s:
                async with self._room:
                    if slot.engine is not None and not self._busy(slot):  # (unchanged while the lock was waited)
                        await self._unload(slot, f"idle for {idle_s:g} s")

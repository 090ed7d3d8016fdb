"""`RayEngine`: the front end's engine when `--data-parallel-size N` spreads requests over Ray replicas.

It offers what the server asks of an `AsyncEngine` (add requests, stream their outputs, abort, validate,
snapshot, health) and routes each prompt to a `Replica` actor (replicas.py says how).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from tokenmill.assembly import kv_manager, load_front
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import RequestFailedError
from tokenmill.engine.validation import output_budget
from tokenmill.kv_cache import KVManager
from tokenmill.metrics import EngineSnapshot
from tokenmill.outputs import RequestOutput
from tokenmill.parallel.replicas import Replica, Router
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output import StructuredOutputManager
from tokenmill.types import EngineRequest

log = logging.getLogger("tokenmill.parallel")
HEALTH_EVERY_S = 0.5


def _ray() -> Any:
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "600")  # a busy machine is not a dead GCS
    os.environ.setdefault("RAY_install_failure_signal_handler", "0")  # no C++ stack dump on a clean SIGTERM
    try:
        import ray
    except ImportError:
        raise ValueError("data_parallel_size > 1 runs on Ray: pip install 'tokenmill[ray]'") from None
    return ray


class RayStream:
    """One request's outputs from its replica; `close()` before the end aborts it there."""

    def __init__(self, engine: RayEngine, request: EngineRequest, replica: int) -> None:
        self.engine, self.request, self.replica = engine, request, replica
        self.request_id = request.request_id
        self.finished = self._closed = False
        self._gen: Any = None
        self._got_output = False

    def __aiter__(self) -> RayStream:
        return self

    async def __anext__(self) -> RequestOutput:
        ray = _ray()
        while True:
            if self.finished or self._closed:
                raise StopAsyncIteration
            if self._gen is None:
                actor = self.engine.actors[self.replica]
                self._gen = actor.generate.options(num_returns="streaming").remote(self.request)
            try:
                out: RequestOutput = await (await self._gen.__anext__())
            except StopAsyncIteration:
                self._end()
                raise
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                self.engine.router.up[self.replica] = False
                if self._got_output:  # it had started there: its tokens so far are gone with the replica
                    self._end()
                    raise RequestFailedError(f"engine replica {self.replica} died: {type(e).__name__}") from None
                self._move()  # it had not started: send it to another replica
                continue
            except ray.exceptions.RayTaskError as e:  # the replica raised (the request failed in its engine)
                self._end()
                raise RequestFailedError(str(e.cause) if getattr(e, "cause", None) else str(e)) from None
            self._got_output = True
            if out.error is not None:
                self._end()
                raise RequestFailedError(out.error)
            if out.finished:
                self._end()
            return out

    def _move(self) -> None:
        router = self.engine.router
        router.load[self.replica] -= self.request.params.n
        self.replica = router.pick(self.request.prompt_token_ids, self.request.params.n, avoid=self.replica)
        self._gen = None
        log.warning("request %s moved to replica %d: its replica died before it started", self.request_id,
                    self.replica)  # fmt: skip

    def _end(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.router.load[self.replica] -= self.request.params.n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._end()
            if self._gen is not None:
                self.engine.actors[self.replica].abort.remote(self.request_id)


class RayEngine:
    def __init__(self, cfg: EngineConfig, size: int, address: str | None) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                     **({} if address else {"num_cpus": max(size, 1)}))  # fmt: skip
        self.front = load_front(cfg)  # tokenizer, sampling defaults, EOS ids: no weights
        if self.front.task.pooling is not None:
            raise ValueError(f"data_parallel_size > 1 serves generation only; this checkpoint is served for "
                             f"{', '.join(self.front.task.names)}")  # fmt: skip
        self.task = self.front.task
        self.tokenizer = self.front.tokenizer
        self.structured = StructuredOutputManager(self.tokenizer.rust, self.front.config.vocab_size,
                                                  self.front.eos_token_ids)  # fmt: skip
        per = replace(cfg, threads=cfg.threads or 1)
        cls = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0, max_concurrency=1000)(Replica)
        self.actors = [cls.options(name=None).remote(per) for _ in range(size)]
        infos = ray.get([a.info.remote() for a in self.actors])
        first = infos[0]
        self.max_model_len, self.vocab_size = int(first["max_model_len"]), int(first["vocab_size"])
        self.description = f"{size} Ray replicas of: {first['description']}"
        self.pids = [int(i["pid"]) for i in infos]
        blocks, block_size = int(first["num_blocks"]), int(first["block_size"])  # the same pool on every replica
        self._kv: KVManager = kv_manager(blocks, block_size, prefix_caching=False)
        self.router = Router(size)
        self.errored: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._snapshots = [EngineSnapshot() for _ in range(size)]
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._poll, name="tokenmill-replicas", daemon=True)
        self._watch.start()

    # -- what the server asks ---------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.errored is None and any(self.router.up)

    def default_sampling_params(self) -> SamplingParams:
        return self.front.default_sampling_params()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return output_budget(prompt_token_ids, params, self.vocab_size, self.max_model_len, self._kv)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """Compile here to check the grammar (a 400 before routing); the replica compiles its own copy."""
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)
        return None

    def add_requests(
        self, prompts: list[list[int]], params: SamplingParams, request_ids: list[str], priority: int = 0,
        grammar: Any = None,
    ) -> list[RayStream]:  # fmt: skip
        budgets = [self.validate(p, params) for p in prompts]
        arrival = time.perf_counter()
        streams = []
        for rid, ids, budget in zip(request_ids, prompts, budgets, strict=True):
            request = EngineRequest(rid, ids, params, budget, None, arrival, 0.0, priority)
            streams.append(RayStream(self, request, self.router.pick(ids, params.n)))
        return streams

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, **_: Any) -> RayStream:  # fmt: skip
        import uuid

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.add_requests([ids], params, [request_id or uuid.uuid4().hex], priority)[0]

    def snapshot(self) -> EngineSnapshot:
        snaps = self._snapshots
        total = {f.name: sum(getattr(s, f.name) for s in snaps) for f in fields(EngineSnapshot)
                 if f.name not in ("mean_batch_size", "max_batch_size")}  # fmt: skip
        return replace(snaps[0], **total, max_batch_size=max(s.max_batch_size for s in snaps))

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica's process id (as it started) and whether the router sends it work."""
        return [{"replica": i, "pid": pid, "up": up} for i, (pid, up) in enumerate(zip(self.pids, self.router.up))]

    def replica_snapshots(self) -> dict[str, EngineSnapshot]:
        return {str(i): s for i, s in enumerate(self._snapshots)}

    @property
    def num_pending(self) -> int:
        return self.snapshot().waiting

    def abort(self, request_id: str) -> None:
        for actor in self.actors:
            actor.abort.remote(request_id)

    def abort_all(self) -> None:
        log.warning("abort_all: open streams end as their clients close them")

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    # -- health and numbers, on a thread ----------------------------------------------------------------------
    def _poll(self) -> None:
        ray = _ray()
        while not self._stop.wait(HEALTH_EVERY_S):
            for i, actor in enumerate(self.actors):
                try:
                    self._snapshots[i] = ray.get(actor.snapshot.remote(), timeout=5)
                    self.router.up[i] = True
                except Exception:  # dead, or restarting: route around it until it answers again
                    self.router.up[i] = False

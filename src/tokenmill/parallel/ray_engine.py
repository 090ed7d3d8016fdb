"""`RayEngine`: the front end's engine when `--data-parallel-size N` spreads requests over Ray replicas.

It offers what the server asks of an `AsyncEngine` (add requests, stream their outputs, abort, validate,
snapshot, health) and routes each prompt to a `Replica` actor (replicas.py says how).

Its watch thread is the one writer of the replicas' handles, process ids and states. Every `HEALTH_EVERY_S` it
reads each replica's snapshot; a replica that Ray reports dead is started again after a backoff
(`RestartPolicy`: `--replica-restart-backoff` seconds, doubled for each restart of that replica, at most
`--replica-max-restarts` times), one log line at its death and one when it is back. Ray's own actor restarts
are off, so the backoff, the limit and the count are ours. When every replica is dead with no restart left,
the engine is dead: the server exits 1, as for any engine death.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from tokenmill import reaper
from tokenmill.assembly import kv_manager, load_front
from tokenmill.config import EngineConfig
from tokenmill.engine.request_stream import RequestFailedError
from tokenmill.engine.validation import output_budget
from tokenmill.errors import LoraError
from tokenmill.kv_cache import KVManager
from tokenmill.metrics import EngineSnapshot, ReplicaState
from tokenmill.outputs import RequestOutput
from tokenmill.parallel.replicas import Replica, Router
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output import StructuredOutputManager
from tokenmill.types import EngineRequest

log = logging.getLogger("tokenmill.parallel")
HEALTH_EVERY_S = 0.5


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 10  # per replica
    backoff_s: float = 1.0  # before its first restart; doubled for each later one
    max_backoff_s: float = 60.0

    def delay(self, restarts: int) -> float:
        return float(min(self.backoff_s * 2**restarts, self.max_backoff_s))


def _ray() -> Any:
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "600")  # a busy machine is not a dead GCS
    # Ray's C++ crash handler (absl's) takes SIGTERM from uvicorn's handler once Ray starts: the server dumped a
    # stack and died by SIGABRT instead of draining and exiting 0 (found by scripts/soak.py). Read at import.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError:
        raise ValueError("data_parallel_size > 1 runs on Ray: pip install 'tokenmill[ray]'") from None
    return ray


def _start_ray(ray: Any, address: str | None, size: int) -> threading.Event:
    """`ray.init` on a thread that lives until Ray is shut down (set the event returned then). Ray binds its
    daemons' lives to the thread that started them (PR_SET_PDEATHSIG): started on the server's loader thread, the
    GCS and raylet died as soon as the model had loaded, so no replica could ever be restarted and Ray's agents
    were left running. Bound to this thread, they also die with the server when it is killed."""
    reaper.before_spawn()  # Ray's daemons
    started, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                     **({} if address else {"num_cpus": max(size, 1)}))  # fmt: skip
        except BaseException as e:
            failed.append(e)
        finally:
            started.set()
        stop.wait()

    threading.Thread(target=run, name="tokenmill-ray", daemon=True).start()
    started.wait()
    if failed:
        raise failed[0]
    return stop


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
    def __init__(self, cfg: EngineConfig, size: int, address: str | None, restarts: RestartPolicy | None = None,
                 ) -> None:  # fmt: skip
        ray = _ray()
        self._ray_thread = _start_ray(ray, address, size) if not ray.is_initialized() else None
        self.front = load_front(cfg)  # tokenizer, sampling defaults, EOS ids: no weights
        if self.front.task.pooling is not None:
            raise ValueError(f"data_parallel_size > 1 serves generation only; this checkpoint is served for "
                             f"{', '.join(self.front.task.names)}")  # fmt: skip
        self.task = self.front.task
        self.tokenizer = self.front.tokenizer
        self.structured = StructuredOutputManager(self.tokenizer.rust, self.front.config.vocab_size,
                                                  self.front.eos_token_ids)  # fmt: skip
        per = replace(cfg, threads=cfg.threads or 1)
        # no restarts by Ray: the watch thread restarts a dead replica, with its backoff and limit
        cls = ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0, max_concurrency=1000)(Replica)
        self._new_replica = lambda: cls.remote(per)
        self.policy = restarts or RestartPolicy()
        self.actors = [self._new_replica() for _ in range(size)]
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
        self.serving = [True] * size  # alive and loaded (the router's `up` also drops one slow to answer)
        self.restarts = [0] * size
        self._pending: dict[int, tuple[float, Any]] = {}  # dead replica -> (when to restart, its info() once started)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._poll, name="tokenmill-replicas", daemon=True)
        self._watch.start()

    # -- what the server asks ---------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        """False only when no replica serves nor will (no restarts left): the server must then end."""
        return self.errored is None and (any(self.serving) or bool(self._pending))

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
        grammar: Any = None, lora: str | None = None,
    ) -> list[RayStream]:  # fmt: skip
        """As `AsyncEngine.add_requests`; replicas serve no LoRA adapters (`lora` must be None)."""
        if lora is not None:
            raise LoraError(f"no LoRA adapter {lora!r}: data-parallel replicas serve none", status=404)
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
        """Each replica's process id, whether the router sends it work, whether it serves, and its restarts."""
        return [{"replica": i, "pid": self.pids[i], "up": self.router.up[i], "serving": self.serving[i],
                 "restarts": self.restarts[i]} for i in range(len(self.actors))]  # fmt: skip

    def replica_states(self) -> dict[str, ReplicaState]:
        return {str(i): ReplicaState(self.serving[i], self.restarts[i]) for i in range(len(self.actors))}

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
        """Stop watching, end the replicas, and stop the Ray this process started (its daemons with it)."""
        self._stop.set()
        self._watch.join(timeout=timeout)
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self._ray_thread is not None:  # the Ray this process started: its daemons end with it
            ray.shutdown()
            self._ray_thread.set()

    # -- health, numbers and restarts, on a thread ------------------------------------------------------------
    def _poll(self) -> None:
        ray = _ray()
        while not self._stop.wait(HEALTH_EVERY_S):
            for i, actor in enumerate(self.actors):
                if i in self._pending:
                    self._restart_step(ray, i)
                    continue
                try:
                    self._snapshots[i] = ray.get(actor.snapshot.remote(), timeout=5)
                    self.router.up[i] = True
                except ray.exceptions.ActorUnavailableError:  # unreachable for now: route around it
                    self.router.up[i] = False
                except ray.exceptions.RayActorError as e:  # dead
                    self._died(i, e)
                except Exception:  # slow to answer on a busy machine: route around it until it answers again
                    self.router.up[i] = False

    def _died(self, i: int, error: BaseException) -> None:
        self.serving[i] = self.router.up[i] = False
        self._snapshots[i] = EngineSnapshot()
        cause = type(error).__name__
        if self.restarts[i] >= self.policy.max_restarts:
            log.error("engine replica %d (pid %d) died (%s) and has no restarts left (--replica-max-restarts %d)",
                      i, self.pids[i], cause, self.policy.max_restarts)  # fmt: skip
            if not any(self.serving) and not self._pending:
                self.errored = RequestFailedError("every engine replica died")
                if self.on_death is not None:
                    self.on_death(self.errored)
            return
        delay = self.policy.delay(self.restarts[i])
        log.warning("engine replica %d (pid %d) died (%s): restarting it in %.1f s (restart %d of at most %d)", i,
                    self.pids[i], cause, delay, self.restarts[i] + 1, self.policy.max_restarts)  # fmt: skip
        self._pending[i] = (time.monotonic() + delay, None)

    def _restart_step(self, ray: Any, i: int) -> None:
        """Start replica i again once its backoff has passed; put it back in service once it has loaded."""
        at, started = self._pending[i]
        if started is None:
            if time.monotonic() >= at:
                ray.kill(self.actors[i], no_restart=True)
                self.restarts[i] += 1
                self.actors[i] = self._new_replica()
                self._pending[i] = (at, self.actors[i].info.remote())
            return
        if not ray.wait([started], timeout=0)[0]:
            return  # still loading
        del self._pending[i]
        try:
            self.pids[i] = int(ray.get(started)["pid"])
        except Exception as e:  # it died again while loading
            self._died(i, e)
            return
        self.serving[i] = self.router.up[i] = True
        log.warning("engine replica %d is back (pid %d) after restart %d", i, self.pids[i], self.restarts[i])

"""Engine-wide statistics (what each step did, running totals) and the Prometheus collectors that export
them. Filled by the engine core and the server; never called from model code. Per-request facts live in
`outputs.RequestMetrics`."""

from __future__ import annotations

import contextlib
import resource
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.outputs import RequestMetrics


def processes() -> list[Any]:
    """This process and every live one it started (a server's engine process, tensor-parallel workers, its reaper):
    what a server's memory and CPU count, whichever process the engine runs in."""
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def rss_mb() -> float:
    """The resident memory now of this process and those it started (`processes`), in MiB."""
    import psutil

    total = 0
    for p in processes():
        with contextlib.suppress(psutil.Error):  # (one that ended since it was listed)
            total += p.memory_info().rss
    return total / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident memory so far plus each live process it started's own peak, in MiB (Linux
    reports ru_maxrss in KiB; a process's peak is its VmHWM): at least the peak of their sum."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for p in processes()[1:]:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            status = Path(f"/proc/{p.pid}/status").read_text()
            peak += int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024
    return peak


@dataclass
class StepStats:
    batch_size: int  # requests that computed tokens this step
    num_tokens: int  # tokens computed (prefill chunks + decodes)
    num_decode_tokens: int  # of which single-token decodes (a decode run's steps each)
    kv_usage: float  # fraction of KV blocks in use after the step (0 for the baselines)
    duration_s: float


@dataclass
class EngineStats:
    num_steps: int = 0
    sum_batch_size: int = 0
    max_batch_size: int = 0
    num_preemptions: int = 0
    num_completed: int = 0
    num_aborted: int = 0
    num_failed: int = 0  # requests a failure inside the engine ended (the others went on)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_draft_tokens: int = 0  # speculative drafts verified
    spec_accepted_tokens: int = 0  # of which the target kept
    recent_steps: deque[StepStats] = field(default_factory=lambda: deque(maxlen=1024))

    def record(self, step: StepStats) -> None:
        self.num_steps += 1
        self.sum_batch_size += step.batch_size
        self.max_batch_size = max(self.max_batch_size, step.batch_size)
        self.recent_steps.append(step)

    @property
    def mean_batch_size(self) -> float:
        return self.sum_batch_size / self.num_steps if self.num_steps else 0.0


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's numbers after one step, published by the loop thread as one frozen object; /stats,
    /metrics and admission read only this. `waiting` and `running` count sequences (n > 1 counts n)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # of prefix_cache_hits, those found in the pool, in the RAM tier and on disk (kv_cache/tiers.py)
    prefix_cache_pool_hits: int = 0
    prefix_cache_ram_hits: int = 0
    prefix_cache_disk_hits: int = 0
    prefix_cache_ram_bytes: int = 0  # bytes of KV blocks the RAM tier holds now
    prefix_cache_disk_bytes: int = 0  # and the disk tier
    num_preemptions: int = 0
    num_steps: int = 0
    mean_batch_size: float = 0.0
    max_batch_size: int = 0
    num_completed: int = 0
    num_aborted: int = 0
    num_failed: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # tokens so far, counted as the engine makes them (the Prometheus counters count at each request's end)
    prompt_tokens: int = 0
    generation_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return 1 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hits_by_tier(self) -> dict[str, int]:
        return {"pool": self.prefix_cache_pool_hits, "ram": self.prefix_cache_ram_hits,
                "disk": self.prefix_cache_disk_hits}  # fmt: skip

    @property
    def prefix_cache_tier_bytes(self) -> dict[str, int]:
        return {"ram": self.prefix_cache_ram_bytes, "disk": self.prefix_cache_disk_bytes}


@dataclass(frozen=True)
class ReplicaState:
    """One data-parallel replica as the front end sees it: serving (alive and answering), and restarts so far."""

    serving: bool
    restarts: int


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)  # fmt: skip


class PrometheusMetrics:
    """The server's Prometheus collectors, named after vLLM's with a `tokenmill:` prefix."""

    def __init__(
        self,
        model_names: list[str],
        snapshots: Callable[[], dict[tuple[str, str], EngineSnapshot]],
        by_replica: bool = False,
        fleet: Callable[[], dict[str, ReplicaState]] | None = None,
    ) -> None:
        """`snapshots`: each engine's snapshot by (model name, replica); `by_replica`: data parallel, whose engine
        numbers then carry a `replica` label (else the replica is ""). `fleet`: each data-parallel replica's
        `ReplicaState` (`tokenmill:replicas_serving`, `tokenmill:replica_restarts`)."""
        from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, ProcessCollector

        self.registry = CollectorRegistry()
        self.model_name = model_names[0] if len(model_names) == 1 else ""  # the process's label
        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}

        def hist(name: str, doc: str) -> Any:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, **kw)

        self.ttft = hist("tokenmill:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist(
            "tokenmill:inter_token_latency_seconds",
            "Gap between consecutive output tokens (0 between the tokens of a decode run or of kept drafts, which "
            "arrive together).",
        )
        self.tpot = hist(
            "tokenmill:request_time_per_output_token_seconds",
            "Each request's time from its first token to its last, over the tokens after the first.",
        )
        self.e2e = hist("tokenmill:e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = hist("tokenmill:request_queue_time_seconds", "Arrival to first scheduled.")
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens processed.", **kw)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated.", **kw)
        per_model = (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens)
        for family in per_model:  # every model's series from the start, at zero
            for name in model_names:
                family.labels(name)
        self.success = Counter(
            "tokenmill:request_success",
            "Finished requests by reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes
        GCCollector(registry=self.registry)  # python_gc_collections_total{generation}, ..._objects_collected_total
        self.registry.register(_CollectorState())
        self.registry.register(_EngineCollector(self.model_name, snapshots, by_replica))
        if fleet is not None:
            self.registry.register(_FleetCollector(self.model_name, fleet))

    def track_models(self, states: Callable[[], dict[str, str]]) -> None:
        """Several models behind one server: each one's state (`states`: name -> loaded | loading | unloaded) as
        gauges, and its loads, unloads and load times (`observe_load`, `observe_unload`)."""
        from prometheus_client import Counter, Histogram

        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}
        self.loads = Counter("tokenmill:model_loads", "Times a model was loaded.", **kw)
        self.unloads = Counter("tokenmill:model_unloads", "Times a model was unloaded (LRU, idle or a dead engine).",
                               **kw)  # fmt: skip
        self.load_seconds = Histogram("tokenmill:model_load_seconds", "Seconds a model took to load.",
                                      buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320), **kw)  # fmt: skip
        self.registry.register(_ModelStates(states))

    def observe_load(self, model_name: str, seconds: float) -> None:
        self.loads.labels(model_name).inc()
        self.load_seconds.labels(model_name).observe(seconds)

    def observe_unload(self, model_name: str) -> None:
        self.unloads.labels(model_name).inc()

    def observe_finished(self, m: RequestMetrics, finish_reasons: list[str | None], model_name: str) -> None:
        self.prompt_tokens.labels(model_name).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(model_name).inc(m.num_generated_tokens)
        for reason in finish_reasons:
            self.success.labels(model_name, reason or "unknown").inc()
        if m.first_token_time is not None:
            self.ttft.labels(model_name).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(model_name).observe(m.first_scheduled_time - m.arrival_time)
        if m.last_token_time is not None:
            self.e2e.labels(model_name).observe(m.last_token_time - m.arrival_time)
        for gap_ms in m.itl_ms:
            self.itl.labels(model_name).observe(gap_ms / 1000)
        if m.first_token_time is not None and m.last_token_time is not None and m.num_generated_tokens > 1:
            tpot = (m.last_token_time - m.first_token_time) / (m.num_generated_tokens - 1)
            self.tpot.labels(model_name).observe(tpot)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


class _ModelStates:
    """`tokenmill:model_loaded` (1 while loaded) and `tokenmill:model_loading` (1 while loading), per model."""

    def __init__(self, states: Callable[[], dict[str, str]]) -> None:
        self.states = states

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        states = self.states()
        for status in ("loaded", "loading"):
            f = GaugeMetricFamily(f"tokenmill:model_{status}", f"1 while the model is {status}.", labels=["model_name"])
            for name, state in states.items():
                f.add_metric([name], 1.0 if state == status else 0.0)
            yield f


class _CollectorState:
    """Python's cyclic collector as memory.py leaves it once a model has loaded: `tokenmill:python_gc_enabled` (1 or
    0) and `tokenmill:python_gc_frozen_objects` (the objects a kept model's load froze out of its sight)."""

    def collect(self) -> Iterator[Any]:
        import gc

        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("tokenmill:python_gc_enabled", "1 while Python's cyclic collector runs.",
                                value=float(gc.isenabled()))  # fmt: skip
        frozen = float(gc.get_freeze_count())
        yield GaugeMetricFamily("tokenmill:python_gc_frozen_objects", "Objects frozen out of the collector's sight "
                                "once a kept model loaded (gc.freeze).", value=frozen)  # fmt: skip


class _EngineCollector:
    def __init__(
        self, model_name: str, snapshots: Callable[[], dict[tuple[str, str], EngineSnapshot]], labelled: bool = False
    ) -> None:
        import psutil

        self.model_name, self.snapshots, self.labelled = model_name, snapshots, labelled
        self._procs: dict[int, psutil.Process] = {}  # each kept across scrapes: its CPU use counts from the last
        self._cpu_percent()  # (the first call primes the counters)

    def _cpu_percent(self) -> float:
        import psutil

        total = 0.0
        for p in processes():
            kept = self._procs.setdefault(p.pid, p)
            with contextlib.suppress(psutil.Error):
                total += kept.cpu_percent(None)
        return total

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snaps = self.snapshots()
        names = ["model_name", "replica"] if self.labelled else ["model_name"]

        def labels(key: tuple[str, str]) -> list[str]:
            return list(key) if self.labelled else [key[0]]

        def family(kind: Any, name: str, doc: str, value: Callable[[EngineSnapshot], float]) -> Any:
            f = kind(name, doc, labels=names)
            for key, s in snaps.items():
                f.add_metric(labels(key), value(s))
            return f

        def gauge(name: str, doc: str, value: Callable[[EngineSnapshot], float]) -> Any:
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name: str, doc: str, value: Callable[[EngineSnapshot], float]) -> Any:
            return family(CounterMetricFamily, name, doc, value)

        yield gauge("tokenmill:num_requests_running", "Requests computing tokens.", lambda s: s.running)
        yield gauge("tokenmill:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.waiting)
        yield gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", lambda s: s.kv_usage)
        yield counter("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s.prefix_cache_queries)  # fmt: skip
        yield counter("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      lambda s: s.prefix_cache_hits)  # fmt: skip
        yield self._by_tier(snaps, CounterMetricFamily, "tokenmill:prefix_cache_hits_by_tier",
                            "Prompt tokens found in the prefix cache, by where: pool, ram or disk.",
                            lambda s: s.prefix_cache_hits_by_tier)  # fmt: skip
        yield self._by_tier(snaps, GaugeMetricFamily, "tokenmill:prefix_cache_tier_bytes",
                            "Bytes of KV blocks the prefix cache's RAM and disk tiers hold.",
                            lambda s: s.prefix_cache_tier_bytes)  # fmt: skip
        yield counter(
            "tokenmill:num_preemptions", "Requests preempted (to be recomputed).", lambda s: s.num_preemptions
        )
        # vLLM's names for speculative decoding: drafts verified, drafts kept, and their ratio
        yield counter("tokenmill:spec_decode_num_draft_tokens", "Speculative drafts verified.",
                      lambda s: s.spec_draft_tokens)  # fmt: skip
        yield counter("tokenmill:spec_decode_num_accepted_tokens", "Speculative drafts the target kept.",
                      lambda s: s.spec_accepted_tokens)  # fmt: skip
        yield gauge("tokenmill:spec_decode_draft_acceptance_rate", "Kept / verified speculative drafts.",
                    lambda s: s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0)  # fmt: skip
        process = [GaugeMetricFamily("tokenmill:process_cpu_percent", "CPU use of the server's processes (this one "
                                     "and those it started: the engine's) since the last scrape.",
                                     labels=["model_name"]),
                   GaugeMetricFamily("tokenmill:process_rss_bytes", "Resident memory of the server's processes (this "
                                     "one and those it started: the engine's).", labels=["model_name"])]  # fmt: skip
        process[0].add_metric([self.model_name], self._cpu_percent())
        process[1].add_metric([self.model_name], rss_mb() * 2**20)
        yield from process

    def _by_tier(self, snaps: dict[tuple[str, str], EngineSnapshot], kind: Any, name: str, doc: str,
                 values: Callable[[EngineSnapshot], dict[str, int]]) -> Any:  # fmt: skip
        """A family with a `tier` label (and `replica` where labelled), one sample per tier a snapshot has."""
        f = kind(name, doc, labels=["model_name", *(["replica"] if self.labelled else []), "tier"])
        for (model, replica), s in snaps.items():
            for tier, value in values(s).items():
                f.add_metric([model, *([replica] if self.labelled else []), tier], value)
        return f


class _FleetCollector:
    """How many data-parallel replicas serve, how many were asked for, and each one's restarts."""

    def __init__(self, model_name: str, fleet: Callable[[], dict[str, ReplicaState]]) -> None:
        self.model_name, self.fleet = model_name, fleet

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        states = self.fleet()
        serving = GaugeMetricFamily("tokenmill:replicas_serving", "Data-parallel replicas serving now.",
                                    labels=["model_name"])  # fmt: skip
        serving.add_metric([self.model_name], sum(s.serving for s in states.values()))
        wanted = GaugeMetricFamily("tokenmill:replicas_desired", "Data-parallel replicas asked for.",
                                   labels=["model_name"])  # fmt: skip
        wanted.add_metric([self.model_name], len(states))
        restarts = CounterMetricFamily("tokenmill:replica_restarts", "Data-parallel replicas started again after "
                                       "dying.", labels=["model_name", "replica"])  # fmt: skip
        for replica, s in states.items():
            restarts.add_metric([self.model_name, replica], s.restarts)
        yield from (serving, wanted, restarts)

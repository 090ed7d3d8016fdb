"""The container image and the monitoring stack in deploy/: every metric the Grafana dashboard asks for is one the
server exports, and, where a Docker daemon answers, the image builds and serves the demo model until healthy."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tokenmill.metrics import EngineSnapshot, PrometheusMetrics, ReplicaState

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tokenmill.json"


def _exported_names() -> set[str]:
    """The sample names a data-parallel server's /metrics holds (histograms as their _bucket, _sum, _count)."""
    snap = EngineSnapshot()
    metrics = PrometheusMetrics(["m"], lambda: {("m", "0"): snap}, True, lambda: {"0": ReplicaState(True, 0)})
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    # the TYPE lines: a labelled family has no sample before its first observation
    families = re.findall(r"^# TYPE (\S+) (\S+)$", metrics.render().decode(), re.M)
    return {name.removesuffix("_total") + end for name, kind in families for end in suffixes.get(kind, ())}


def test_the_dashboard_asks_only_for_exported_metrics() -> None:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    asked = {name for e in exprs for name in re.findall(r"tokenmill:[a-zA-Z0-9_:]+", e)}
    assert len(asked) >= 10, asked  # throughput, latencies, queues, KV, prefix cache, drafts, errors, replicas
    assert asked <= _exported_names(), asked - _exported_names()


def _daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def test_the_image_builds_and_serves_until_healthy() -> None:
    if not _daemon():
        pytest.skip("no Docker daemon answers here: the image is not built")
    tag, name = f"tokenmill-test:{uuid.uuid4().hex[:8]}", f"tokenmill-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "build", "-t", tag, str(ROOT)], check=True, timeout=3600)
    try:
        subprocess.run(["docker", "run", "-d", "--name", name, tag], check=True, timeout=60)
        deadline = time.monotonic() + 600
        while (status := _health(name)) != "healthy":
            assert status in ("starting", "") and time.monotonic() < deadline, status
            time.sleep(2)  # bounded polling of Docker's own HEALTHCHECK
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def _health(name: str) -> str:
    out = subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", name], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    return out.stdout.strip()

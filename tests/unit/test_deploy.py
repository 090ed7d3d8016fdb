"""The container image and the monitoring stack in deploy/: every metric the Grafana dashboard asks for is one the
server exports, and, where a Docker daemon answers, the image builds, serves the demo model (healthy, one
completion) and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shlex
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


def _build_args() -> list[str]:
    """TOKENMILL_IMAGE_BUILD_ARGS="KEY=VALUE ..." (e.g. where no registry serves base images: BASE_IMAGE=a local
    base, TORCH_PIP_ARGS=...; docs/api.md, "Container and monitoring")."""
    return [f"--build-arg={kv}" for kv in shlex.split(os.environ.get("TOKENMILL_IMAGE_BUILD_ARGS", ""))]


def test_the_image_builds_serves_and_drains_on_sigterm() -> None:
    if not _daemon():
        pytest.skip("no Docker daemon answers here: the image is not built")
    tag, name = f"tokenmill-test:{uuid.uuid4().hex[:8]}", f"tokenmill-test-{uuid.uuid4().hex[:8]}"
    # the build's network is the host's (pip and apt reach out whatever the daemon's bridge); the container needs
    # none: its HEALTHCHECK and the request below run inside it
    subprocess.run(["docker", "build", "--network", "host", *_build_args(), "-t", tag, str(ROOT)], check=True,
                   timeout=3600)  # fmt: skip
    try:
        subprocess.run(["docker", "run", "-d", "--network", "none", "--name", name, tag], check=True, timeout=60)
        deadline = time.monotonic() + 600
        while (status := _inspect(name, "{{.State.Health.Status}}")) != "healthy":
            assert status in ("starting", "") and time.monotonic() < deadline, status
            time.sleep(2)  # bounded polling of Docker's own HEALTHCHECK
        body = json.dumps({"model": "tokenmill-demo", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
        out = subprocess.run(["docker", "exec", name, "curl", "-fsS", "http://127.0.0.1:8000/v1/completions", "-H",
                              "Content-Type: application/json", "-d", body], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["usage"]["completion_tokens"] == 5, out.stdout
        subprocess.run(["docker", "stop", "-t", "60", name], check=True, capture_output=True, timeout=120)  # SIGTERM
        assert _inspect(name, "{{.State.ExitCode}}") == "0"  # drained and exited, not killed after the 60 s
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def _inspect(name: str, template: str) -> str:
    out = subprocess.run(["docker", "inspect", "-f", template, name], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()

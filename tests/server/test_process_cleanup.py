"""Nothing `tokenmill serve` started outlives it, however it ends: SIGTERM and SIGINT with tensor-parallel workers,
SIGKILL in the middle of a kernel build (its compiler jobs, in the engine's process), and a start that fails after
Ray's daemons are up; a plain serve starts only its engine's process, and no reaper.
(SIGKILL with Ray's replicas: tests/server/test_data_parallel.py; a dead worker rank: test_tensor_parallel_serve.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.pooling_checkpoints import bare_decoder
from tests.server.helpers import HOST, free_port, running
from tests.server.processes import assert_none_left, started_by
from tokenmill import kernels

STARTUP_TIMEOUT_S = 120.0


def _serve(model: Path, log: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill", "serve", str(model), "--host", HOST, "--port", str(free_port()),
           "--dtype", "float32", *flags]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})  # fmt: skip


def _watch_until(proc: subprocess.Popen[bytes], found: dict[psutil.Process, str], done: str | None) -> None:
    """Collect `proc`'s descendants and their command lines until one holds `done` (None: until `proc` exits)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while proc.poll() is None:
        try:
            procs = started_by(proc.pid)
        except psutil.NoSuchProcess:
            break
        # read every poll, keeping the last non-empty line: a process caught between its fork and its exec shows
        # its parent's command line (Ray's gcs_server read as "python -m tokenmill serve"), or none yet
        for p in procs:
            cmd = " ".join(_cmdline(p))
            if cmd or p not in found:
                found[p] = cmd
        if done is not None and any(done in cmd for cmd in found.values()):
            return
        assert time.monotonic() < deadline, "never got there"
        time.sleep(0.02)  # bounded polling
    assert done is None, f"the server exited ({proc.returncode}) before any {done!r} ran"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_a_plain_serve_starts_only_its_engine(checkpoint: Path, tmp_path: Path) -> None:
    """Its engine's process (which ends with it by itself), and no reaper: nothing else to reap. In one process
    (--no-engine-process), no process at all."""
    kernels.active()  # built into the cache first where they build here: a serve that compiles them starts a reaper
    with running(checkpoint, tmp_path, "--threads", "1") as server:
        started = [" ".join(_cmdline(p)) for p in started_by(server.proc.pid)]
        assert len(started) == 1 and "tokenmill.server.engine_process" in started[0], started
    with running(checkpoint, tmp_path, "--threads", "1", "--no-engine-process") as server:
        started = [" ".join(_cmdline(p)) for p in started_by(server.proc.pid)]
        assert started == [], started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_tensor_parallel_workers(checkpoint: Path, tmp_path: Path, sig: signal.Signals) -> None:
    with running(checkpoint, tmp_path, "--tensor-parallel-size", "2", "--threads", "1") as server:
        started = started_by(server.proc.pid)
        assert any("spawn_main" in " ".join(_cmdline(p)) for p in started), [p.cmdline() for p in started]
        server.proc.send_signal(sig)
        assert server.proc.wait(timeout=60) in (0, 130), server.log_tail()  # 130: SIGINT, as a shell reports it
    assert_none_left(started, sig.name)


def test_sigkill_during_a_kernel_build_ends_its_compiler(checkpoint: Path, tmp_path: Path) -> None:
    # a fresh cache: the server compiles the kernels for this CPU first (about a minute, on one core)
    proc = _serve(checkpoint, tmp_path / "server.log", "--threads", "1",
                  env={"TOKENMILL_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    found: dict[psutil.Process, str] = {}
    try:
        _watch_until(proc, found, "cc1plus")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert_none_left(list(found), "SIGKILL during a kernel build")


def test_a_failed_start_ends_rays_daemons(tokenizer_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenmill[ray]' to run this test")
    # an embedding model: Ray starts, then the front end refuses it (data parallel serves generation only)
    model = bare_decoder("qwen3", tokenizer_dir, tmp_path / "bare")
    log = tmp_path / "server.log"
    proc = _serve(model, log, "--data-parallel-size", "2", "--threads", "1")
    found: dict[psutil.Process, str] = {}
    _watch_until(proc, found, None)
    assert proc.wait(timeout=60) == 2
    names = " ".join(found.values())
    assert "raylet" in names and "gcs_server" in names, names  # Ray had started: the test saw something to clean up
    errors = [line for line in log.read_text().splitlines() if line.startswith("tokenmill serve: error:")]
    assert len(errors) == 1 and "generation only" in errors[0], log.read_text()[-2000:]
    assert_none_left(list(found), "a failed start")

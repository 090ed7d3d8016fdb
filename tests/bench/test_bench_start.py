"""`tokenmill bench start` on a tiny checkpoint: real `tokenmill serve` launches timed to their first 200 from
/health, beside a peer server in llama-server's place (a small HTTP server taking llama-server's flags: the real
one is not installed here), and the one-line errors for a peer that dies or cannot run. No timing thresholds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# llama-server's command line as bench start gives it; answers /health with 200 once listening
PEER = """
import argparse, http.server
p = argparse.ArgumentParser()
for flag in ("-m", "--port", "-t", "-tb", "-np", "-c"):
    p.add_argument(flag)
a = p.parse_args()
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *_):
        pass
http.server.HTTPServer(("127.0.0.1", int(a.port)), Health).serve_forever()
"""


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2")


def _executable(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def _bench_start(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill", "bench", "start", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def test_rounds_time_both_servers_and_give_the_ratio(model: Path, tmp_path: Path) -> None:
    peer = _executable(tmp_path, "peer-server", PEER)
    done = _bench_start(str(model), "--rounds", "2", "--warmup", "1", "--llama-server", str(peer), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["rounds"] == 2 and set(result["seconds"]) == {"tokenmill", "llama-server"}
    for times in result["seconds"].values():
        assert len(times) == 2 and all(t > 0 for t in times)
    medians = result["median_s"]
    assert result["ratio"] == pytest.approx(medians["tokenmill"] / medians["llama-server"])


@pytest.mark.parametrize(("peer_body", "said"), [("import sys; sys.exit(3)", "exited with status 3 before it was "
                                                  "healthy"), (None, "cannot run llama-server")])  # fmt: skip
def test_a_peer_that_dies_or_cannot_run_is_one_line(model: Path, tmp_path: Path, peer_body: str | None,
                                                    said: str) -> None:  # fmt: skip
    peer = _executable(tmp_path, "peer-server", peer_body) if peer_body else tmp_path / "no-such-server"
    done = _bench_start(str(model), "--rounds", "1", "--warmup", "0", "--llama-server", str(peer))
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert said in line and "Traceback" not in done.stderr


def test_bad_counts_are_one_line(model: Path) -> None:
    done = _bench_start(str(model), "--rounds", "0")
    assert done.returncode == 2 and "--rounds must be >= 1" in done.stderr and "Traceback" not in done.stderr

"""`tokenmill bench start`: seconds from launching a server to its first 200 from /health, on a warm page cache.

`tokenmill serve MODEL` and, with `--llama-server BIN`, llama-server on the same file, launched in turn round by
round (a drift of the machine falls on both), each stopped once it answers. Untimed warm-up launches come first:
they fill the page cache and whatever a first start writes (the packed weights, the kept tokenizer), so the rounds
time the start a user gets every day after the first. A server that exits or does not answer within --timeout
is one line saying which, with its log's last line.

Prints each round, the medians and ranges, and tokenmill's median over llama-server's; `--json` prints them as
JSON. Draws nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tokenmill.errors import TokenmillError

POLL_S = 0.02  # between /health requests


def run_start(args: argparse.Namespace) -> dict[str, Any]:
    if args.rounds < 1 or args.warmup < 0 or not args.timeout > 0:
        raise ValueError("--rounds must be >= 1, --warmup >= 0 and --timeout > 0")
    servers = _commands(args)
    times: dict[str, list[float]] = {name: [] for name in servers}
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-start-") as logs:
        for i in range(args.warmup + args.rounds):
            for name, command in servers.items():
                seconds = _time_to_healthy(name, command, Path(logs) / f"{name}.log", args.timeout)
                if i >= args.warmup:
                    times[name].append(seconds)
            if i >= args.warmup and not args.json:
                print(f"round {i - args.warmup + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()))
    result = {"model": args.model, "rounds": args.rounds, "seconds": times,
              "median_s": {n: statistics.median(t) for n, t in times.items()}}  # fmt: skip
    if "llama-server" in times:
        result["ratio"] = result["median_s"]["tokenmill"] / result["median_s"]["llama-server"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for n, t in times.items():
            print(f"{n}: median {statistics.median(t):.3f} s (range {min(t):.3f}-{max(t):.3f}) of {len(t)}")
        if "ratio" in result:
            print(f"tokenmill / llama-server: {result['ratio']:.2f}x")
    return result


def _commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each server's command, with `{port}` where its port goes."""
    threads = str(args.threads or os.cpu_count() or 1)
    tokenmill = [sys.executable, "-m", "tokenmill", "serve", args.model, "--port", "{port}",
                 *shlex.split(args.serve_args)]  # fmt: skip
    commands = {"tokenmill": tokenmill}
    if args.llama_server:
        commands["llama-server"] = [args.llama_server, "-m", args.model, "--port", "{port}", "-t", threads,
                                    "-tb", threads, *shlex.split(args.llama_args)]  # fmt: skip
    return commands


def _time_to_healthy(name: str, command: list[str], log: Path, timeout: float) -> float:
    """Launch `command` on a free port, and the seconds until its /health answers 200; the server is stopped."""
    port = _free_port()
    argv = [part.replace("{port}", str(port)) for part in command]
    with log.open("wb") as out:
        start = time.perf_counter()
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as e:
            raise TokenmillError(f"cannot run {name} ({argv[0]}): {e.strerror or e}") from None
        try:
            while not _healthy(port):
                if proc.poll() is not None:
                    raise TokenmillError(f"{name} exited with status {proc.returncode} before it was "
                                         f"healthy: {_last_line(log)}")  # fmt: skip
                if time.perf_counter() - start > timeout:
                    raise TokenmillError(f"{name} was not healthy within {timeout:g} s: {_last_line(log)}")
                time.sleep(POLL_S)
            return time.perf_counter() - start
        finally:
            _stop(proc)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 while it loads
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def add_start_parser(sub: Any) -> None:
    p = sub.add_parser("start", help="seconds from launch to a healthy server, against llama-server on the same file")
    p.add_argument("model", help="a model folder or GGUF file (a GGUF for --llama-server)")
    p.add_argument("--rounds", type=int, default=5, help="timed launches of each server, alternated")
    p.add_argument("--warmup", type=int, default=1, help="untimed launches of each first (page cache, first-start "
                   "caches)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a launch may take to be healthy")
    p.add_argument("--serve-args", default="", help="extra `tokenmill serve` flags, as one string")
    p.add_argument("--llama-server", default=None, help="llama-server's binary: time it too, on the same file")
    p.add_argument("--llama-args", default="-np 16 -c 8192", help="llama-server's flags besides -m, --port, -t, -tb")
    p.add_argument("--threads", type=int, default=None, help="llama-server's -t and -tb (default: every core)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

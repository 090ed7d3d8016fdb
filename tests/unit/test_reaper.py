"""The reaper starts when a server first starts a process, and only then; once started, a SIGKILL of the server
still ends what it started (the server-level cases: tests/server/test_process_cleanup.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import psutil

from tests.server.processes import assert_none_left, started_by

# a stand-in server: arms (or not), calls before_spawn, starts a long sleep, prints its pid and waits to be killed
SERVER = textwrap.dedent("""
    import subprocess, sys, time
    from tokenmill import reaper
    if sys.argv[1] == "armed":
        reaper.arm()
    reaper.before_spawn()
    reaper.before_spawn()  # a second call starts no second reaper
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _stand_in(mode: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _names(procs: list[psutil.Process]) -> list[str]:
    return [" ".join(p.cmdline()) for p in procs]


def test_an_armed_process_starts_one_reaper_and_a_sigkill_ends_its_child() -> None:
    proc, child = _stand_in("armed")
    try:
        started = started_by(proc.pid)
        reapers = [n for n in _names(started) if "tokenmill.reaper" in n]
        assert len(reapers) == 1 and any(p.pid == child for p in started), _names(started)
        assert psutil.Process(child).environ().get("TOKENMILL_SERVER_ID")  # marked before it started
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert_none_left(started, "SIGKILL of an armed process")


def test_a_process_not_armed_starts_no_reaper() -> None:
    proc, child = _stand_in("plain")
    try:
        started = started_by(proc.pid)
        assert [p.pid for p in started] == [child], _names(started)
        assert "TOKENMILL_SERVER_ID" not in psutil.Process(child).environ()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(child).kill()

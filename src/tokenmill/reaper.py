"""The server's reaper: a small watchdog process that ends every process `tokenmill serve` started once the server
is gone, however it went (a clean stop, SIGINT, a failed start's `os._exit`, or SIGKILL, which runs no cleanup).

It starts when it has something to watch: `tokenmill serve` calls `arm()`, and each place that starts a process
(a kernel build's compiler jobs, Ray's daemons and replicas, tensor-parallel workers, torch.compile's and Triton's
compiler jobs) calls `before_spawn()` first. The first such call in an armed process marks its environment with a
fresh id (TOKENMILL_SERVER_ID, inherited by every process it starts from then on) and starts
`python -m tokenmill.reaper PID`, whose stdin is a pipe only the server holds. A server that starts no process
starts no reaper (a plain CPU serve of a cached model: the reaper's ~15 MB are not held beside it). The reaper
notes the server's descendants every `SCAN_S` seconds; when the pipe reaches its end (the server's last file
descriptor closed, by exit or by kill), it terminates what it noted that still runs as the same process, and every
process carrying the id (one started after the last scan, or reparented away from the server's tree), waits
`GRACE_S`, then kills what is left. It ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole foreground group, and
the reaper must outlive the server to clean up after it. It imports nothing heavy (psutil only).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import uuid

import psutil

ENV = "TOKENMILL_SERVER_ID"
SCAN_S = 0.5
GRACE_S = 3.0


_lock = threading.Lock()
_armed = False
_started: subprocess.Popen[bytes] | None = None  # owned here: the one reaper of this process


def arm() -> None:
    """This process is a server: the processes it starts from now on are reaped when it ends."""
    global _armed
    _armed = True


def before_spawn() -> None:
    """Call before starting a process: in an armed process, the first call starts the reaper (any thread)."""
    global _started
    with _lock:
        if _armed and _started is None:
            os.environ[ENV] = uuid.uuid4().hex
            _started = subprocess.Popen([sys.executable, "-m", "tokenmill.reaper", str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)  # fmt: skip


def _marked(server_id: str, me: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != me and p.environ().get(ENV) == server_id:
                found.append(p)
        except (psutil.Error, OSError):  # gone, or not ours to read
            continue
    return found


def _leftovers(seen: dict[int, float], server_id: str, me: int) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {p.pid: p for p in _marked(server_id, me)}
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:  # the same process, not a new one that took its id
                procs[pid] = p
                procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            continue
    procs.pop(me, None)
    return list(procs.values())


def _end(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=GRACE_S)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants(server: psutil.Process, me: int) -> dict[int, float]:
    found = {}
    try:
        children = server.children(recursive=True)
    except psutil.Error:
        return {}
    for c in children:
        try:
            if c.pid != me:
                found[c.pid] = c.create_time()
        except psutil.Error:  # ended since
            continue
    return found


def watch(server_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    me, server_id = os.getpid(), os.environ.get(ENV, "")
    seen: dict[int, float] = {}
    try:
        server = psutil.Process(server_pid)
    except psutil.Error:
        server = None
    while server is not None:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], SCAN_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):  # end of file: the server is gone
            break
        if not _alive(server):
            break
        seen.update(_descendants(server, me))
    if server_id:
        _end(_leftovers(seen, server_id, me))


if __name__ == "__main__":
    watch(int(sys.argv[1]))

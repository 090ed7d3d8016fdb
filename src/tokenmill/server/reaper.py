"""The server's reaper: a small watchdog process that ends every process `tokenmill serve` started once the server
is gone, however it went (a clean stop, SIGINT, a failed start's `os._exit`, or SIGKILL, which runs no cleanup).

`start_reaper()` marks the server's environment with a fresh id (TOKENMILL_SERVER_ID, inherited by every process
it starts: Ray's daemons and replicas, tensor-parallel workers, the compiler jobs of a kernel build) and starts
`python -m tokenmill.server.reaper PID`, whose stdin is a pipe only the server holds. The reaper notes the server's
descendants every `SCAN_S` seconds; when the pipe reaches its end (the server's last file descriptor closed, by
exit or by kill), it terminates what it noted that still runs as the same process, and every process carrying the
id (one started after the last scan, or reparented away from the server's tree), waits `GRACE_S`, then kills
what is left. It ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole foreground group, and the reaper must
outlive the server to clean up after it. It imports nothing heavy (psutil only).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import uuid

import psutil

ENV = "TOKENMILL_SERVER_ID"
SCAN_S = 0.5
GRACE_S = 3.0


def start_reaper() -> subprocess.Popen[bytes]:
    """Mark this process's environment and start its reaper (call before starting any other process)."""
    os.environ[ENV] = uuid.uuid4().hex
    return subprocess.Popen([sys.executable, "-m", "tokenmill.server.reaper", str(os.getpid())],
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

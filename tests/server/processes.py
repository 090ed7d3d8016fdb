"""What a test server started: its processes, and a check that none outlives it."""

from __future__ import annotations

import psutil

LEFT_AFTER_S = 30.0  # the reaper ends what is left within seconds (tokenmill/reaper.py); this only bounds the wait


def started_by(pid: int) -> list[psutil.Process]:
    """Every process below `pid` now (Ray's daemons and replicas, tensor-parallel workers, the reaper)."""
    return psutil.Process(pid).children(recursive=True)


def assert_none_left(procs: list[psutil.Process], how: str) -> None:
    """Each of `procs` ends (the same process: psutil checks its start time), within LEFT_AFTER_S."""
    _, alive = psutil.wait_procs(procs, timeout=LEFT_AFTER_S)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            continue
    assert not left, f"after {how}, still running:\n" + "\n".join(left)

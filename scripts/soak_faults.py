"""The soak's fault mode (scripts/soak.py --data-parallel-size 2 --kill-replica-every S): replicas killed on a
schedule, the restarts the server reports, and the RSS of the server, its replicas and its other processes."""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from typing import Any

import httpx
import psutil

MB = 2**20


def _rss(pid: int) -> float | None:
    try:
        return round(psutil.Process(pid).memory_info().rss / MB, 1)
    except psutil.NoSuchProcess:  # a replica killed between /stats and now
        return None


class RssSampler:
    """RSS (MB) over time: the server process, each replica (by the pids /stats gives now), and the rest of the
    server's process tree (Ray's daemons, the reaper) summed."""

    def __init__(self, server_pid: int, client: httpx.AsyncClient) -> None:
        self.server_pid, self.client = server_pid, client
        self.samples: list[dict[str, Any]] = []

    async def sample(self, t: float) -> None:
        stats = (await self.client.get("/stats", timeout=30)).json()
        replicas = [r["pid"] for r in stats.get("replicas", [])]
        try:
            tree = psutil.Process(self.server_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        others = sum(r for p in tree if p.pid not in replicas and (r := _rss(p.pid)) is not None)
        self.samples.append({"t": round(t), "server": _rss(self.server_pid), "replicas": [_rss(p) for p in replicas],
                             "others": round(others, 1)})  # fmt: skip

    async def run(self, start: float, deadline: float, every: float) -> None:
        while (now := time.monotonic()) < deadline:
            await self.sample(now - start)
            await asyncio.sleep(min(every, max(deadline - time.monotonic(), 0)))

    def summary(self) -> dict[str, Any]:
        """The server's RSS at start (idle), once warm (the first measured sample), at its peak and at the end;
        each replica slot's and the rest's peak and end; and every sample."""
        server = [s["server"] for s in self.samples if s["server"] is not None]
        out: dict[str, Any] = {"server": {"start": server[0], "warm": server[1] if len(server) > 1 else server[0],
                                          "max": max(server), "end": server[-1]}}  # fmt: skip
        slots = max(len(s["replicas"]) for s in self.samples)
        if slots:
            per = [[s["replicas"][i] for s in self.samples if len(s["replicas"]) > i and s["replicas"][i]]
                   for i in range(slots)]  # fmt: skip
            out["replicas"] = [{"max": max(p), "end": p[-1]} for p in per if p]
            out["others"] = {"max": max(s["others"] for s in self.samples), "end": self.samples[-1]["others"]}
        out["samples"] = self.samples
        return out


async def kill_replicas(client: httpx.AsyncClient, start: float, deadline: float, args: argparse.Namespace,
                        kills: list[dict[str, Any]]) -> None:  # fmt: skip
    """Every --kill-replica-every seconds until the deadline, SIGKILL a serving replica's process (the replicas in
    turn; one still restarting is passed over), found by its pid in /stats as the tests find it."""
    if not args.kill_replica_every:
        return
    turn = 0
    while (at := start + (len(kills) + 1) * args.kill_replica_every) < deadline:
        await asyncio.sleep(max(at - time.monotonic(), 0))
        replicas = (await client.get("/stats", timeout=30)).json()["replicas"]
        serving = [r for r in replicas if r["serving"]]
        if not serving:
            kills.append({"t": round(time.monotonic() - start), "replica": None, "pid": None})
            continue
        victim = min(serving, key=lambda r: (r["replica"] - turn) % len(replicas))
        psutil.Process(victim["pid"]).kill()
        kills.append({"t": round(time.monotonic() - start), "replica": victim["replica"], "pid": victim["pid"]})
        turn = victim["replica"] + 1


async def fault_figures(client: httpx.AsyncClient, args: argparse.Namespace,
                        kills: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The kills, the restarts the server counts (/metrics), and its replicas once all serve again (or 180 s)."""
    for _ in range(180):
        replicas = (await client.get("/stats", timeout=30)).json()["replicas"]
        if all(r["serving"] for r in replicas):
            break
        await asyncio.sleep(1)
    metrics = (await client.get("/metrics", timeout=30)).text
    restarts = re.findall(r'^tokenmill:replica_restarts_total\{[^}]*replica="(\d+)"[^}]*\} ([0-9.e+]+)$', metrics,
                          re.M)  # fmt: skip
    log = args.log.read_text(errors="replace")
    return {"kills": kills, "restarts": {r: int(float(v)) for r, v in restarts},
            "replicas_after": [{k: r[k] for k in ("replica", "serving", "restarts")} for r in replicas],
            "log_lines": {"died": log.count(") died ("), "back": log.count(" is back (pid"),
                          "moved": log.count(": its replica died before it started")}}  # fmt: skip

"""`tokenmill serve --data-parallel-size 2`: two single-thread engine replicas as Ray actors on a local Ray,
behind one OpenAI front end. 32 concurrent requests come back as one engine would give them and both replicas
work; prompts with a shared prefix go to one replica (its prefix cache hits); a killed replica loses no request
that had not started on it, the server goes on serving (degraded) and the replica comes back; a killed server
leaves no process behind."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import httpx
import openai
import psutil
import pytest

from tests.server.helpers import Server, offline
from tests.server.hold import Hold
from tests.server.processes import assert_none_left, started_by
from tokenmill import LLM

pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenmill[ray]' to run the data-parallel tests")

SERVER_FLAGS = ("--data-parallel-size", "2", "--threads", "1", "--replica-restart-backoff", "2")
HOLD_TOKEN = 8  # a prompt starting with it is held mid-request on its replica (tests/server/hold.py)


def _read_per_replica(server: Server, metric: str) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = rf'^{re.escape(metric)}\{{[^}}]*replica="(\d+)"[^}}]*\}} ([0-9.e+]+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def _per_replica(server: Server, metric: str, until: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The replicas' numbers once `until` holds: the front end polls them (every 0.5 s, each poll up to 5 s per
    replica on a busy machine), so a fixed sleep could read a poll from before the requests."""
    deadline = time.monotonic() + 60
    while not until(values := _read_per_replica(server, metric)):
        assert time.monotonic() < deadline, f"{metric} per replica never got there: {values}"
        time.sleep(0.1)  # bounded polling
    return values


def _client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0)


def test_32_concurrent_requests_use_both_replicas(server: Server, llm: LLM) -> None:
    prompts = [[11 + i % 7, 12, 13 + i] for i in range(32)]

    async def main() -> list[str]:
        client = _client(server)
        rs = await asyncio.gather(*[client.completions.create(model=server.model, prompt=p, max_tokens=10,
                                                              temperature=0) for p in prompts])  # fmt: skip
        return [r.choices[0].text for r in rs]

    texts = asyncio.run(main())
    assert texts == [offline(llm, {"prompt_token_ids": p}, 10, ignore_eos=False).text for p in prompts]
    _per_replica(server, "tokenmill:prefix_cache_queries_total",
                 lambda q: set(q) == {"0", "1"} and all(v > 0 for v in q.values()))  # fmt: skip


def test_a_shared_prefix_goes_to_one_replica(server: Server) -> None:
    prefix = [(7 * i) % 300 + 3 for i in range(64)]
    # no earlier test's prompt has a whole block in common with another: the hits so far stay 0 whatever the
    # polls show, and a stale reading of them changes nothing
    before = _read_per_replica(server, "tokenmill:prefix_cache_hits_total")

    async def main() -> None:
        client = _client(server)
        for i in range(6):  # one after another: no replica is loaded, so the prefix decides
            await client.completions.create(model=server.model, prompt=[*prefix, 100 + i], max_tokens=2)

    asyncio.run(main())
    after = _per_replica(server, "tokenmill:prefix_cache_hits_total",
                         lambda a: max(v - before.get(r, 0) for r, v in a.items()) >= 5 * 64)  # fmt: skip
    gained = {r: after[r] - before.get(r, 0) for r in after}
    assert sorted(gained.values())[0] == 0 and max(gained.values()) >= 5 * 64, gained


def test_a_killed_replica_loses_no_request_that_had_not_started_and_comes_back(server: Server) -> None:
    replicas = httpx.get(f"{server.url}/stats", timeout=10).json()["replicas"]
    assert [r["up"] for r in replicas] == [True, True]
    killed = replicas[0]["pid"]
    psutil.Process(killed).kill()  # the front end learns of it at its next poll; requests sent before then are moved

    async def main() -> list[str | None]:
        client = _client(server)
        rs = await asyncio.gather(*[client.completions.create(model=server.model, prompt=[20 + i, 21], max_tokens=4)
                                    for i in range(8)])  # fmt: skip
        return [r.choices[0].finish_reason for r in rs]

    assert asyncio.run(main()) == ["length"] * 8
    # fewer replicas than asked for: degraded (200), until the dead one is back after its backoff and load
    _health_until(server, lambda r: r.status_code == 200 and r.content and r.json()["status"] == "degraded")
    _health_until(server, lambda r: r.status_code == 200 and not r.content)
    replicas = httpx.get(f"{server.url}/stats", timeout=10).json()["replicas"]
    assert [(r["serving"], r["restarts"]) for r in replicas] == [(True, 1), (True, 0)], replicas
    assert replicas[0]["pid"] != killed
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r"^tokenmill:replicas_serving\{[^}]*\} 2\.0$", metrics, re.M), metrics
    assert re.search(r'^tokenmill:replica_restarts_total\{[^}]*replica="0"\} 1\.0$', metrics, re.M)
    log = server.log_tail(100_000)
    assert log.count("engine replica 0 (pid") == 1 and log.count("engine replica 0 is back") == 1, log[-3000:]
    # the replica that came back serves: requests spread over both replicas again
    before = _read_per_replica(server, "tokenmill:prefix_cache_queries_total").get("0", 0)

    async def spread() -> None:
        client = _client(server)
        await asyncio.gather(*[client.completions.create(model=server.model, prompt=[60 + i, 61], max_tokens=2)
                               for i in range(8)])  # fmt: skip

    asyncio.run(spread())
    _per_replica(server, "tokenmill:prefix_cache_queries_total", lambda q: q.get("0", 0) > before)


def _health_until(server: Server, ok: Callable[[httpx.Response], bool]) -> None:
    deadline = time.monotonic() + 120  # a restart loads a whole engine on a busy machine
    while not ok(r := httpx.get(f"{server.url}/health", timeout=10)):
        assert time.monotonic() < deadline, f"/health never got there: {r.status_code} {r.text}"
        time.sleep(0.05)  # bounded polling


def test_a_disconnect_aborts_the_request_on_its_replica(server: Server, hold: Hold) -> None:
    def aborted() -> int:
        return int(httpx.get(f"{server.url}/stats", timeout=10).json()["aborted_requests"])

    before = aborted()  # no earlier test aborts a request: a stale poll reads the same
    # its replica holds it after its first tokens until the abort arrives: no CPU finishes it first
    body = {"model": server.model, "prompt": [HOLD_TOKEN, 40, 41], "max_tokens": 500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept: a dropped iterator closes the response early
        first = next(line for line in lines if line.startswith("data:"))
        assert '"text"' in first, first
        hold.wait_held()
    deadline = time.monotonic() + 10  # the client left after one chunk: its replica aborts the request
    while aborted() != before + 1:
        assert time.monotonic() < deadline, "the request was not aborted on its replica"
        time.sleep(0.2)
    _per_replica(server, "tokenmill:num_requests_running", lambda r: len(r) == 2 and max(r.values()) == 0)


def test_a_killed_server_leaves_no_process_behind(server: Server) -> None:
    """Last: SIGKILL runs no cleanup in the server; its reaper ends Ray's daemons, agents and replicas."""
    started = started_by(server.proc.pid)
    names = " ".join(" ".join(p.cmdline()) for p in started)
    assert "raylet" in names and "ray::Replica" in names and "tokenmill.reaper" in names, names
    server.proc.kill()
    server.proc.wait(timeout=10)
    assert_none_left(started, "SIGKILL")

"""Failures inside the engine, and the end of the server's life.

- A request that makes the engine fail (the runner's test hook: a prompt starting with the fault token) fails
  alone: the requests beside it finish with exactly their tokens, and the server keeps serving.
- A failure the engine loop cannot survive makes the server exit 1 within seconds, for a supervisor to restart.
- On SIGTERM, streams still open when the grace period runs out end with finish_reason "abort" and [DONE].
- This module's server takes its API key from TOKENMILL_API_KEY and serves /docs openly (--public-docs).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.helpers import Server, offline, running, sse_events, sse_json
from tokenmill import LLM

FAULT = 7  # the runner raises on a sequence whose first token is this id
KEY = "env-key"
SERVER_ENV = {"TOKENMILL_TEST_FAULT_TOKEN": str(FAULT), "TOKENMILL_API_KEY": KEY}
SERVER_FLAGS = ("--public-docs",)
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = [[11, 12, 13], [20, 21], [30, 31, 32, 33]]


def _body(server: Server, prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **fields}


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


def test_a_request_that_breaks_the_engine_fails_alone(server: Server, http: httpx.Client, llm: LLM) -> None:
    expected = [offline(llm, {"prompt_token_ids": p}, 12).text for p in GOOD]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as client:
            calls = [client.post("/v1/completions", json=_body(server, p)) for p in GOOD]
            calls.insert(1, client.post("/v1/completions", json=_body(server, [FAULT, 1, 2])))
            return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    bad = responses.pop(1)
    assert bad.status_code == 500, bad.text
    assert "generation failed" in bad.json()["error"]["message"] and "injected fault" in bad.json()["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    # the stream of a failing request ends in-band: an error event, then [DONE]
    with http.stream("POST", "/v1/completions", json=_body(server, [FAULT, 3], stream=True)) as r:
        events = sse_events(r.read().decode())
    payloads = sse_json(events)
    assert "injected fault" in payloads[-1]["error"]["message"]
    # and the server serves on, with nothing held
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=_body(server, GOOD[0])).json()["choices"][0]["text"] == expected[0]
    stats = http.get("/stats").json()
    assert stats["failed_requests"] == 2 and stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0


def test_key_from_the_environment_and_public_docs(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        r = anonymous.post("/v1/completions", json=_body(server, "Hi"))
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert anonymous.get("/openapi.json").status_code == 200  # --public-docs
        assert anonymous.get("/docs").status_code == 200


def test_a_dead_engine_loop_exits_the_server_nonzero(checkpoint: Path, tmp_path: Path) -> None:
    env = {"TOKENMILL_TEST_FAULT_TOKEN": str(FAULT), "TOKENMILL_TEST_FAULT_FATAL": "1"}
    with running(checkpoint, tmp_path, env=env) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            r = client.post("/v1/completions", json=_body(server, [FAULT, 1]))
        assert r.status_code == 500 and "engine loop has stopped" in r.json()["error"]["message"]
        assert server.proc.wait(timeout=30) == 1, server.log_tail()
        assert "the engine loop died" in server.log_tail()


def test_streams_open_at_the_end_of_the_grace_period_end_cleanly(checkpoint: Path, tmp_path: Path) -> None:
    # every step sleeps 50 ms first (the runner's test hook), and a step gives a sequence at most 4 tokens (a decode
    # run), so a 480-token request takes at least 6 s on any CPU: none can finish within the 0.6 s grace period
    flags = ("--grace-period", "0.6", "--max-num-seqs", "1")
    streams = 8
    with running(checkpoint, tmp_path, *flags, env={"TOKENMILL_TEST_STEP_DELAY_S": "0.05"}) as server:
        body = _body(server, "Hello", max_tokens=480, stream=True)
        raw: list[str] = []

        async def read(client: httpx.AsyncClient, started: Callable[[], None]) -> None:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                started()
                raw.append((await r.aread()).decode())

        async def main() -> None:
            opened = asyncio.Event()
            count = [0]

            def started() -> None:
                count[0] += 1
                if count[0] == streams:
                    opened.set()

            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                tasks = [asyncio.create_task(read(client, started)) for _ in range(streams)]
                await asyncio.wait_for(opened.wait(), 30)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.gather(*tasks)

        asyncio.run(main())
        assert server.proc.wait(timeout=30) == 0, server.log_tail()
    assert len(raw) == streams
    last_finishes = []
    for text in raw:
        chunks = sse_json(sse_events(text))  # every stream ends with [DONE], none is cut
        last_finishes.append([c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1])
    assert last_finishes == ["abort"] * streams, last_finishes


def test_waiting_never_counts_aborts(server: Server, http: httpx.Client) -> None:
    """Requests dropped by their clients leave the queue count; it never exceeds what was sent."""
    body = _body(server, "Hello", max_tokens=400, n=4, stream=True)
    seen: list[int] = []

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AUTH) as client:

            async def drop() -> None:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break  # the client goes away after the first line

            await asyncio.gather(*(drop() for _ in range(6)))

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while True:
        stats = http.get("/stats").json()
        seen.append(stats["waiting"])
        if stats["running"] == stats["waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert max(seen) <= 6 * 4 and seen[-1] == 0 and stats["running"] == 0, seen
    assert json.loads(http.get("/stats").text)["kv_blocks_used"] == 0

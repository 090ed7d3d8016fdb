"""Soak test: keep `tokenmill serve` at twice its capacity for a while with a hostile mix of clients, and check
that nothing is lost, hung or leaked. Outside CI (minutes); docs/reliability.md has its figures.

    .venv/bin/python scripts/soak.py [MODEL] --duration 300 --max-num-seqs 8 --max-waiting-requests 16

Capacity is --max-num-seqs running + --max-waiting-requests queued sequences; 2x capacity client workers (or
--workers) loop over five kinds of request (all greedy, ignore_eos, so every finished request owes exactly its tokens):
stream (read to the end), plain (non-streaming), n3 (n=3), long (a prompt that fills the context) and drop
(a stream the client closes after a few chunks). Reported: completed, 503 (overload, expected), errors (any
other failure: 5xx or transport), hung (no answer within --request-timeout), lost (a finished request
without exactly its tokens), and the server's RSS once warm, at its peak and at the end. Afterwards the
server must be idle with every KV block free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

KINDS = ("stream", "plain", "n3", "long", "drop")


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting-requests", str(args.max_waiting_requests),
           "--served-model-name", "soak", "--touch-kv-cache", "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.log, "wb"))


async def wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen[bytes]) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see its log")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.5)


async def rss_mb(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("process_resident_memory_bytes"))
    return float(line.split()[-1]) / 2**20


async def long_prompt(client: httpx.AsyncClient, args: argparse.Namespace) -> list[int]:
    """Token ids that fill the context but for the longest completion (so a 'long' request is never a 400)."""
    max_len = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
    ids = (await client.post("/tokenize", json={"prompt": "to be or not " * max_len})).json()["tokens"]
    return list(ids[: max_len - args.max_tokens - 1])


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, args: argparse.Namespace) -> str:
    """Send one request of `kind`; return its outcome: ok, 503, error, hung or lost."""
    max_tokens = rng.randrange(4, args.max_tokens + 1)
    words = " ".join(rng.choice(["to", "be", "or", "not"]) for _ in range(rng.randrange(3, 40)))
    prompt: str | list[int] = args.long_ids if kind == "long" else words
    body: dict[str, Any] = {"model": "soak", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}  # fmt: skip
    n = 3 if kind == "n3" else 1
    body["n"] = n
    try:
        if kind == "plain" or kind == "n3" or kind == "long":
            r = await client.post("/v1/completions", json=body, timeout=args.request_timeout)
            if r.status_code != 200:
                return "503" if r.status_code == 503 else "error"
            tokens = r.json()["usage"]["completion_tokens"]
            return "ok" if tokens == n * max_tokens else "lost"
        body.update(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=body, timeout=args.request_timeout) as r:
            if r.status_code != 200:
                await r.aread()
                return "503" if r.status_code == 503 else "error"
            chunks, usage = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    return "error"
                usage = payload.get("usage") or usage
                chunks += 1
                if kind == "drop" and chunks >= 3:
                    return "ok"  # the client goes away; the server must abort and free it
            return "ok" if usage is not None and usage["completion_tokens"] == max_tokens else "lost"
    except httpx.TimeoutException:
        return "hung"
    except httpx.TransportError:
        return "error"


async def worker(client: httpx.AsyncClient, seed: int, deadline: float, args: argparse.Namespace, tally: Counter[str],
                 kinds: Counter[str]) -> None:  # fmt: skip
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        kind = rng.choice(KINDS)
        kinds[kind] += 1
        outcome = await one_request(client, kind, rng, args)
        tally[outcome] += 1
        if outcome == "503":
            await asyncio.sleep(1.0)  # as the server's Retry-After asks


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    port = args.port
    proc = start_server(args, port)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits) as client:
            await wait_healthy(client, proc)
            args.long_ids = await long_prompt(client, args)
            rss_start = await rss_mb(client)
            workers = args.workers or 2 * (args.max_num_seqs + args.max_waiting_requests)
            tally: Counter[str] = Counter()
            kinds: Counter[str] = Counter()
            # a short warm-up at full load, then the measured run
            await asyncio.gather(*(worker(client, -i - 1, time.monotonic() + args.warmup, args, Counter(), Counter())
                                   for i in range(workers)))  # fmt: skip
            rss_warm = await rss_mb(client)
            deadline = time.monotonic() + args.duration
            samples: list[float] = []

            async def sample_rss() -> None:
                while time.monotonic() < deadline:
                    samples.append(await rss_mb(client))
                    await asyncio.sleep(5)

            await asyncio.gather(
                sample_rss(), *(worker(client, i, deadline, args, tally, kinds) for i in range(workers))
            )
            await asyncio.sleep(2)  # the last dropped streams' aborts land within a step
            stats = (await client.get("/stats")).json()
            rss_end = await rss_mb(client)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"workers": workers, "duration_s": args.duration, "requests": sum(tally.values()), "outcomes": dict(tally),
            "kinds": dict(kinds), "rss_mb": {"start": round(rss_start), "warm": round(rss_warm),
            "min_during": round(min(samples + [rss_end])), "max_during": round(max(samples + [rss_end])),
            "end": round(rss_end)},
            "idle_after": {k: stats[k] for k in ("running", "waiting", "kv_blocks_used", "failed_requests")},
            "server_exit": proc.returncode}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the built-in demo model")
    p.add_argument("--duration", type=float, default=300)
    p.add_argument("--warmup", type=float, default=30)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-waiting-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="client workers (default: 2x capacity); fewer than --max-num-seqs keeps the queue empty, "
        "so that the server's decode runs take most steps",
    )
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--log", type=Path, default=Path("/tmp/tokenmill-soak-server.log"))
    result = asyncio.run(soak(p.parse_args()))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

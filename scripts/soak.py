"""Soak test: keep `tokenmill serve` at twice its capacity for a while with a hostile mix of clients, and check
that nothing is lost, hung or leaked. Outside CI (minutes); docs/reliability.md has its figures.

    .venv/bin/python scripts/soak.py [MODEL] --duration 300 --max-num-seqs 8 --max-waiting-requests 16
    .venv/bin/python scripts/soak.py --duration 600 --data-parallel-size 2 --kill-replica-every 120   # faults

Capacity is taken from the server's limits, not measured: --max-num-seqs running on each of the
--data-parallel-size replicas, plus --max-waiting-requests queued sequences; beyond it the server answers 503.
2x capacity client workers (or --workers) loop over five kinds of request (all greedy, ignore_eos, so every
finished request owes exactly its tokens; streams count them from the final `usage` chunk): stream (read to the
end), plain (non-streaming), n3 (n=3), long (a prompt that fills the context) and drop (a stream the client
closes after a few chunks). Outcomes: ok, dropped, 503 (overload), refused (another 4xx), failed (a clean error:
a JSON 5xx, or an error event followed by [DONE]) and lost (anything else: no answer within --request-timeout,
a transport error, a 5xx that is not JSON, a stream without [DONE], a finished request without exactly its
tokens); `accepted` is all but 503 and refused. The script exits 1 if any request was lost.

With --kill-replica-every S (and --data-parallel-size 2 or more) one serving replica's process is SIGKILLed every
S seconds of the measured run, the replicas in turn (soak_faults.py); reported: the kills, the restarts from
/metrics, the server log's lines for them, and the replicas once all serve again. RSS (MB) of the server, each
replica and the rest of its process tree (Ray's daemons) is sampled every --sample-every seconds. Afterwards
the server must be idle with every KV block free, and exit 0 on SIGTERM.
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
from soak_faults import RssSampler, fault_figures, kill_replicas

KINDS = ("stream", "plain", "n3", "long", "drop")
# ok: every token owed; dropped: the client closed the stream (drop); 503: overload, refused before it was accepted;
# refused: another 4xx; failed: a clean error (a JSON 5xx, or an error event then [DONE]); lost:<why>: anything else
OUTCOMES = ("ok", "dropped", "503", "refused", "failed", "lost")


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting-requests", str(args.max_waiting_requests),
           "--served-model-name", "soak", "--touch-kv-cache", "--log-level", "warning"]  # fmt: skip
    if args.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(args.data_parallel_size), "--threads", "1"]
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


async def long_prompt(client: httpx.AsyncClient, args: argparse.Namespace) -> list[int]:
    """Token ids that fill the context but for the longest completion (so a 'long' request is never a 400)."""
    max_len = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
    ids = (await client.post("/tokenize", json={"prompt": "to be or not " * max_len})).json()["tokens"]
    return list(ids[: max_len - args.max_tokens - 1])


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, args: argparse.Namespace) -> str:
    """Send one request of `kind`; return its outcome (OUTCOMES), "lost:<why>" for a lost one."""
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
                return _refusal(r.status_code, r.content)
            tokens = r.json()["usage"]["completion_tokens"]
            return "ok" if tokens == n * max_tokens else "lost:tokens"
        body.update(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=body, timeout=args.request_timeout) as r:
            if r.status_code != 200:
                return _refusal(r.status_code, await r.aread())
            return await _read_stream(r, kind, max_tokens)
    except httpx.TimeoutException:
        return "lost:hung"
    except httpx.TransportError:
        return "lost:transport"


def _refusal(status: int, content: bytes) -> str:
    """A non-200 answer: clean when its body is an OpenAI-style JSON error."""
    try:
        clean = "error" in json.loads(content)
    except ValueError:
        clean = False
    if not clean:
        return "lost:unclean"
    return "503" if status == 503 else "refused" if status < 500 else "failed"


async def _read_stream(r: httpx.Response, kind: str, max_tokens: int) -> str:
    """A stream's outcome: its tokens from the final usage chunk; an error event is clean only if [DONE] follows."""
    chunks, usage, errored = 0, None, False
    async for line in r.aiter_lines():
        if line == "data: [DONE]":
            if errored:
                return "failed"
            return "ok" if usage is not None and usage["completion_tokens"] == max_tokens else "lost:tokens"
        if not line.startswith("data: "):
            continue
        payload = json.loads(line[6:])
        errored = errored or "error" in payload
        usage = payload.get("usage") or usage
        chunks += 1
        if kind == "drop" and chunks >= 3 and not errored:
            return "dropped"  # the client goes away; the server must abort and free it
    return "lost:no-done"  # the stream ended without [DONE]


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


def capacity(args: argparse.Namespace) -> int:
    """The sequences the server holds without a 503: --max-num-seqs running on each replica, plus the queue."""
    return args.data_parallel_size * args.max_num_seqs + args.max_waiting_requests


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    proc = start_server(args, args.port)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=60, limits=limits) as client:
            await wait_healthy(client, proc)
            args.long_ids = await long_prompt(client, args)
            workers = args.workers or 2 * capacity(args)
            tally: Counter[str] = Counter()
            kinds: Counter[str] = Counter()
            rss = RssSampler(proc.pid, client)
            await rss.sample(0.0)
            # a short warm-up at full load, then the measured run
            await asyncio.gather(*(worker(client, -i - 1, time.monotonic() + args.warmup, args, Counter(), Counter())
                                   for i in range(workers)))  # fmt: skip
            start = time.monotonic()
            deadline = start + args.duration
            kills: list[dict[str, Any]] = []
            await asyncio.gather(
                rss.run(start, deadline, args.sample_every),
                kill_replicas(client, start, deadline, args, kills),
                *(worker(client, i, deadline, args, tally, kinds) for i in range(workers)),
            )
            await rss.sample(time.monotonic() - start)
            idle = await wait_idle(client)
            faults = await fault_figures(client, args, kills) if args.data_parallel_size > 1 else {}
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return {"workers": workers, "capacity": capacity(args), "duration_s": args.duration, **summary(tally),
            "kinds": dict(kinds), **faults, "rss_mb": rss.summary(), "idle_after": idle,
            "server_exit": proc.returncode}  # fmt: skip


def summary(tally: Counter[str]) -> dict[str, Any]:
    """The outcomes, with `accepted` (past admission: all but 503 and other 4xx) and `lost` broken down by why."""
    lost = {k.removeprefix("lost:"): v for k, v in tally.items() if k.startswith("lost:")}
    requests = sum(tally.values())
    return {"requests": requests, "accepted": requests - tally["503"] - tally["refused"],
            "outcomes": {k: tally[k] for k in OUTCOMES if k != "lost"} | {"lost": sum(lost.values())},
            "lost_why": lost}  # fmt: skip


async def wait_idle(client: httpx.AsyncClient) -> dict[str, Any]:
    """/stats once the last dropped streams' aborts have landed (replicas' figures are polled: a few seconds)."""
    keys = ("running", "waiting", "kv_blocks_used", "failed_requests")
    for _ in range(60):
        await asyncio.sleep(1)
        stats = (await client.get("/stats")).json()
        if not any(stats[k] for k in keys[:3]):
            break
    return {k: stats[k] for k in keys}


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
    p.add_argument("--request-timeout", type=float, default=120, help="a request without its answer by then is lost")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas (on Ray)")
    p.add_argument("--kill-replica-every", type=float, default=0,
                   help="with --data-parallel-size > 1: SIGKILL one serving replica's process every so many seconds "
                   "of the measured run, taking the replicas in turn (0: never)")  # fmt: skip
    p.add_argument("--sample-every", type=float, default=10, help="seconds between RSS samples")
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--log", type=Path, default=Path("/tmp/tokenmill-soak-server.log"))
    args = p.parse_args()
    if args.kill_replica_every and args.data_parallel_size < 2:
        p.error("--kill-replica-every needs --data-parallel-size 2 or more (one replica must serve on)")
    result = asyncio.run(soak(args))
    print(json.dumps(result, indent=2))
    sys.exit(1 if result["outcomes"]["lost"] else 0)


if __name__ == "__main__":
    main()

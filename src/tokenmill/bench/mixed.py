"""`tokenmill bench serve --embed-rate R`: generation streams with embedding requests arriving beside them (issue 58).

The workload runs twice with the same prompts and seed: first alone, then while a second client posts
`/v1/embeddings` requests (each `--embed-batch` texts of `--embed-len` tokens) at Poisson arrivals of R a second,
from before the second run's first request until its last one ends. A run folder of its own ("mixed") names both
runs and gives, for each stream, its TPOT with the embeddings over its TPOT alone (the same request in both runs),
with the embedding requests' count, latency and prompt tokens a second. The server must serve both (`tokenmill serve
--task generate,embed`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.embed import post_embeddings
from tokenmill.bench.prompts import TokenCounter, fit_text
from tokenmill.bench.serve import run_workload
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run


class EmbedBeside:
    """Embedding requests at Poisson arrivals on a thread of their own, from `start()` until `stop()`."""

    def __init__(self, args: argparse.Namespace, texts: list[list[str]]) -> None:
        self.args, self.texts = args, texts
        self.rows: list[dict[str, Any]] = []
        self.wall = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._drive()), name="embed-beside", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    async def _drive(self) -> None:
        args = self.args
        rng = random.Random(f"{args.seed}-embed-arrivals")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        t0, tasks = time.monotonic(), []
        async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(args.timeout)) as client:  # fmt: skip
            while not self._stop.is_set():
                row: dict[str, Any] = {"index": len(self.rows), "sent": False, "ok": False, "error": None,
                                       "inputs": args.embed_batch}  # fmt: skip
                self.rows.append(row)
                body = {"model": args.model, "input": self.texts[len(self.rows) % len(self.texts)],
                        "encoding_format": "float"}  # fmt: skip
                tasks.append(asyncio.create_task(post_embeddings(client, body, row, t0)))
                await asyncio.to_thread(self._stop.wait, rng.expovariate(args.embed_rate))  # (returns at stop())
            await asyncio.gather(*tasks)
        self.wall = time.monotonic() - t0

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.rows if r["ok"]]
        wall = max(self.wall, 1e-9)
        return {"embed_rate": self.args.embed_rate, "embed_batch": self.args.embed_batch,
                "embed_len": self.args.embed_len, "requests_sent": len(self.rows), "requests_completed": len(ok),
                "requests_errors": len(self.rows) - len(ok), "duration_s": self.wall,
                "request_throughput": len(ok) / wall,
                "prompt_token_throughput": sum(r["prompt_tokens"] for r in ok) / wall,
                "latency_ms": summarize([r["latency_ms"] for r in ok]),
                "errors": sorted({r["error"] for r in self.rows if r["error"]})[:5]}  # fmt: skip


def stream_ratios(alone_dir: Path, mixed_dir: Path) -> list[dict[str, Any]]:
    """Each stream's TPOT in both runs (the same request index), and mixed / alone."""
    alone = {r["index"]: r for r in json.loads((alone_dir / "raw" / "trials.json").read_text())}
    rows = []
    for r in json.loads((mixed_dir / "raw" / "trials.json").read_text()):
        a = alone.get(r["index"])
        if r["ok"] and a and a["ok"] and r["tpot_ms"] and a["tpot_ms"]:
            rows.append({"index": r["index"], "tpot_alone_ms": a["tpot_ms"], "tpot_mixed_ms": r["tpot_ms"],
                         "ratio": r["tpot_ms"] / a["tpot_ms"]})  # fmt: skip
    return rows


def run_mixed(args: argparse.Namespace, workload: str) -> Path:
    """The workload alone, then with embeddings beside it; the "mixed" run folder."""
    seed = args.seed if args.seed is not None else 0
    args = argparse.Namespace(**{**vars(args), "seed": seed, "embed_len": args.embed_len or args.input_len or 128})
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as client:
        counter = TokenCounter(args.tokenizer, client, args.model)
        rng = random.Random(f"{seed}-embed-beside")
        texts = [[fit_text(counter, rng, args.embed_len)[0] for _ in range(args.embed_batch)] for _ in range(16)]
    alone = run_workload(args, workload)
    beside = EmbedBeside(args, texts)
    beside.start()
    try:
        mixed = run_workload(args, workload)
    finally:
        beside.stop()
    ratios = stream_ratios(alone, mixed)
    values = [r["ratio"] for r in ratios]
    summary: dict[str, Any] = {"workload": "mixed", "generation_workload": workload, "alone_run": alone.name,
               "mixed_run": mixed.name, "streams_compared": len(ratios), "tpot_ratio_max": max(values, default=None),
               "tpot_ratio_p50": statistics.median(values) if values else None,
               "embeddings": beside.summary()}  # fmt: skip
    config = {"workload": "mixed", "generation_workload": workload, "url": args.url, "model": args.model,
              "embed_rate": args.embed_rate, "embed_batch": args.embed_batch, "embed_len": args.embed_len,
              "seed": seed, "server_label": args.server_label}  # fmt: skip
    run = Run.create(args.output_dir, "mixed", config)
    run.save_raw(ratios)
    run.save_summary(summary)
    path = run.finish(mixed_report(summary, ratios), model=args.model, backend=args.server_label,
                      headline=("tpot_ratio_max", summary["tpot_ratio_max"] or float("nan"), "x"))  # fmt: skip
    e = summary["embeddings"]
    print(f"mixed: {len(ratios)} streams, TPOT with embeddings / alone: max {summary['tpot_ratio_max'] or 0:.2f}x, "
          f"p50 {summary['tpot_ratio_p50'] or 0:.2f}x; {e['requests_completed']}/{e['requests_sent']} embedding "
          f"requests ok, {e['prompt_token_throughput']:.0f} prompt tok/s -> {path}", flush=True)  # fmt: skip
    return path


def mixed_report(s: dict[str, Any], ratios: list[dict[str, Any]]) -> str:
    e, lat = s["embeddings"], s["embeddings"]["latency_ms"]
    lines = ["# serve benchmark: mixed", "",
             f"`{s['generation_workload']}` alone ({s['alone_run']}), then with embedding requests beside it "
             f"({s['mixed_run']}): {e['embed_rate']} a second, {e['embed_batch']} texts of {e['embed_len']} tokens "
             "each.", "",
             f"- TPOT with the embeddings over TPOT alone, per stream: max {s['tpot_ratio_max'] or 0:.2f}x, p50 "
             f"{s['tpot_ratio_p50'] or 0:.2f}x over {s['streams_compared']} streams",
             f"- embeddings: {e['requests_completed']}/{e['requests_sent']} ok, {e['prompt_token_throughput']:.0f} "
             f"prompt tok/s, latency p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms", "",
             "| stream | TPOT alone ms | TPOT mixed ms | ratio |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['index']} | {r['tpot_alone_ms']:.1f} | {r['tpot_mixed_ms']:.1f} | {r['ratio']:.2f} |"
              for r in ratios]  # fmt: skip
    return "\n".join(lines) + "\n"

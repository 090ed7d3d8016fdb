"""`tokenmill bench serve --workload embed`: a RAG indexer's traffic against `/v1/embeddings`.

`--num-prompts` requests, each embedding `--embed-batch` texts of `--input-len` tokens, at most `--max-concurrency`
in flight (all sent at once otherwise). It records each request's latency and its prompt tokens (`usage`), and the
summary gives requests, texts and prompt tokens per second over the run, with latency percentiles. Any server with
OpenAI's embeddings API takes it (llama-server with `--embedding`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import httpx

from tokenmill.bench.prompts import TokenCounter, fit_text
from tokenmill.bench.stats import summarize


async def post_embeddings(client: httpx.AsyncClient, body: dict[str, Any], row: dict[str, Any], t0: float) -> None:
    start = time.monotonic()
    row.update(sent=True, start_s=start - t0)
    try:
        resp = await client.post("/v1/embeddings", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        if len(data.get("data") or []) != len(body["input"]):
            raise RuntimeError(f"{len(data.get('data') or [])} embeddings for {len(body['input'])} inputs")
        row.update(ok=True, prompt_tokens=int((data.get("usage") or {}).get("prompt_tokens") or 0))
    except Exception as e:  # a failure is a row, never an exception
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
    end = time.monotonic()
    row.update(end_s=end - t0, latency_ms=(end - start) * 1e3)


async def drive_embeddings(args: argparse.Namespace, texts: list[list[str]]) -> tuple[list[dict[str, Any]], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rows: list[dict[str, Any]] = [{"index": i, "sent": False, "ok": False, "error": None, "inputs": len(t)}
                                  for i, t in enumerate(texts)]  # fmt: skip
    sem = asyncio.Semaphore(args.max_concurrency or len(texts))
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:  # fmt: skip

        async def one(i: int) -> None:
            async with sem:
                body = {"model": args.model, "input": texts[i], "encoding_format": "float"}
                await post_embeddings(client, body, rows[i], t0)

        await asyncio.gather(*(one(i) for i in range(len(texts))))
    return rows, time.monotonic() - t0


def run_embed(args: argparse.Namespace) -> Any:
    """The embed workload against `--url`: the run folder, as the other workloads'."""
    from tokenmill.bench.store import Run

    seed = args.seed if args.seed is not None else 0
    n, batch, length = args.num_prompts or 64, args.embed_batch, args.input_len or 128
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as client:
        counter = TokenCounter(args.tokenizer, client, args.model)
        rng = random.Random(f"{seed}-embed")
        texts = [[fit_text(counter, rng, length)[0] for _ in range(batch)] for _ in range(n)]
    config = {"workload": "embed", "num_prompts": n, "embed_batch": batch, "input_len": length,
              "max_concurrency": args.max_concurrency, "url": args.url, "model": args.model, "seed": seed,
              "server_label": args.server_label, "prompt_token_source": counter.source}  # fmt: skip
    run = Run.create(args.output_dir, "embed", config)
    rows, wall = asyncio.run(drive_embeddings(args, texts))
    ok = [r for r in rows if r["ok"]]
    tokens = sum(r["prompt_tokens"] for r in ok)
    summary = {"workload": "embed", "requests_sent": len(rows), "requests_completed": len(ok),
               "requests_errors": len(rows) - len(ok), "duration_s": wall, "request_throughput": len(ok) / wall,
               "input_throughput": sum(r["inputs"] for r in ok) / wall, "prompt_token_throughput": tokens / wall,
               "latency_ms": summarize([r["latency_ms"] for r in ok])}  # fmt: skip
    run.save_raw(rows)
    run.save_summary(summary)
    lat = summary["latency_ms"]
    line = (f"{len(ok)}/{len(rows)} requests ok ({batch} texts of {length} tokens each), "
            f"{summary['input_throughput']:.1f} texts/s, {summary['prompt_token_throughput']:.0f} prompt tokens/s, "
            f"latency p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms")  # fmt: skip
    where = f"`{args.server_label}` at {args.url}, model `{args.model}`, seed {seed}."
    report = f"# serve benchmark: embed\n\n{where}\n\n{line}.\n"
    path = run.finish(report, headline=("input_throughput", summary["input_throughput"], "texts/s"),
                      model=args.model, backend=args.server_label)  # fmt: skip
    print(f"embed: {line} -> {path}", flush=True)
    return path

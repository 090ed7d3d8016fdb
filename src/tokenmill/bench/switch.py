"""`tokenmill bench serve --workload switch`: what switching between the models of one server costs (issue 60).

Against a `tokenmill serve --model A=PATH --model B=PATH ...` (several models, loaded on demand): one request at a
time, to each model of `--request-models` in turn (default: every model /v1/models lists), `--num-prompts` of them
(default two per model). Before and after each request it reads the model's state from /v1/models (a request to a
model not loaded is a cold one), the server's resident memory (`process_resident_memory_bytes` on /metrics) and
its load-time histogram (`tokenmill:model_load_seconds`). With `--idle-wait S` it waits up to S seconds for every
model to be unloaded (the server's `--idle-unload-seconds`) before the first request, for the baseline, and again
after the last, and reads the memory each time.

The figures: a cold request's TTFT (request sent -> first token: the switch, with the load, as a client sees it),
the server's own load seconds, a warm request's TTFT, and the resident memory at the start (the baseline), at its
highest, and after the idle unload. The memory is the server process's own (a data-parallel server's Ray
replicas are other processes).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench.prompts import TokenCounter, fit_text
from tokenmill.bench.serve import _body, _finish_rows, send
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run

MB = 2**20
POLL_S = 0.25  # how often the idle wait reads /v1/models


async def sample(client: httpx.AsyncClient) -> dict[str, Any]:
    """The server now: each model's state, its resident MB, and each model's (load count, load seconds)."""
    cards = (await client.get("/v1/models")).json().get("data") or []
    states = {str(c["id"]): str(c.get("status", "loaded")) for c in cards}
    rss: float | None = None
    loads: dict[str, tuple[float, float]] = {}
    unloads: dict[str, float] = {}
    metrics = await client.get("/metrics")
    if metrics.status_code == 200:
        for family in text_string_to_metric_families(metrics.text):
            for s in family.samples:
                if s.name == "process_resident_memory_bytes":
                    rss = s.value / MB
                elif s.name == "tokenmill:model_unloads_total":
                    unloads[s.labels["model_name"]] = s.value
                elif s.name in ("tokenmill:model_load_seconds_count", "tokenmill:model_load_seconds_sum"):
                    count, total = loads.get(s.labels["model_name"], (0.0, 0.0))
                    loads[s.labels["model_name"]] = ((s.value, total) if s.name.endswith("_count")
                                                     else (count, s.value))  # fmt: skip
    return {"states": states, "rss_mb": rss, "loads": loads, "unloads": unloads}


def _load_seconds(before: dict[str, Any], after: dict[str, Any], model: str) -> float | None:
    """The seconds the server took to load `model` between two samples (None: it did not load)."""
    n0, s0 = before["loads"].get(model, (0.0, 0.0))
    n1, s1 = after["loads"].get(model, (0.0, 0.0))
    return s1 - s0 if n1 > n0 else None


async def wait_unloaded(client: httpx.AsyncClient, bound_s: float) -> tuple[dict[str, Any], float | None]:
    """Read the server until no model is loaded or loading and each load's unload has finished (its memory given
    back: the server counts it then), at most `bound_s`: (the last sample, seconds waited or None where some model
    stayed)."""
    t0 = time.monotonic()
    while True:
        now = await sample(client)
        gone = all(now["unloads"].get(m, 0.0) >= n for m, (n, _) in now["loads"].items())
        if gone and all(state == "unloaded" for state in now["states"].values()):
            return now, time.monotonic() - t0
        if time.monotonic() - t0 > bound_s:
            return now, None
        await asyncio.sleep(POLL_S)


async def drive_switch(args: argparse.Namespace, models: list[str], texts: list[str]) -> dict[str, Any]:
    """Each request in turn with the samples around it; then the idle wait (with --idle-wait)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=httpx.Timeout(args.timeout)) as client:
        # with --idle-wait, the baseline is the server with no model loaded (counting prompt tokens on it may load one)
        start = (await wait_unloaded(client, args.idle_wait))[0] if args.idle_wait else await sample(client)
        last, t0 = start, time.monotonic()
        for i, text in enumerate(texts):
            model = models[i % len(models)]
            body = {**_body(args, text, args.output_len), "model": model}
            row: dict[str, Any] = {"index": i, "model": model, "cold": last["states"].get(model) != "loaded",
                                   "rss_before_mb": last["rss_mb"], "sent": False, "ok": False, "error": None,
                                   "prompt_tokens": args.input_len, "output_tokens": None,
                                   "output_tokens_source": None}  # fmt: skip
            await send(client, args, body, row, t0, args.timeout)
            now = await sample(client)
            row.update(rss_after_mb=now["rss_mb"], load_s=_load_seconds(last, now, model),
                       loaded_after=sorted(m for m, s in now["states"].items() if s == "loaded"))  # fmt: skip
            rows.append(row)
            last = now
        idle, waited = (await wait_unloaded(client, args.idle_wait)) if args.idle_wait else (None, None)
    return {"rows": rows, "start": start, "idle": idle, "idle_waited_s": waited, "wall_s": time.monotonic() - t0}


def _spread(values: list[float]) -> dict[str, float]:
    return {**summarize(values), "max": max(values, default=math.nan)}


def switch_summary(run: dict[str, Any]) -> dict[str, Any]:
    rows, start, idle = run["rows"], run["start"], run["idle"]
    ok = [r for r in rows if r["ok"]]
    rss = [x for r in rows for x in (r["rss_before_mb"], r["rss_after_mb"]) if x is not None]
    return {
        "workload": "switch", "requests_sent": len(rows), "requests_completed": len(ok),
        "cold_requests": sum(1 for r in ok if r["cold"]),
        "cold_ttft_ms": _spread([r["ttft_ms"] for r in ok if r["cold"]]),
        "warm_ttft_ms": _spread([r["ttft_ms"] for r in ok if not r["cold"]]),
        "load_s": _spread([r["load_s"] for r in rows if r["load_s"] is not None]),
        "states_at_start": start["states"], "rss_start_mb": start["rss_mb"], "rss_peak_mb": max(rss, default=None),
        "rss_after_idle_unload_mb": idle["rss_mb"] if idle and run["idle_waited_s"] is not None else None,
        "idle_unload_waited_s": run["idle_waited_s"], "wall_s": run["wall_s"],
    }  # fmt: skip


def switch_report(args: argparse.Namespace, s: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def mb(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    def ms(m: dict[str, Any]) -> str:
        return "-" if not m["n"] else f"p50 {m['p50']:.0f} ms, max {m['max']:.0f} ms over {m['n']}"

    idle = ("not waited for" if not args.idle_wait else f"{mb(s['rss_after_idle_unload_mb'])} MB after every model "
            f"was unloaded ({s['idle_unload_waited_s']:.1f} s)" if s["idle_unload_waited_s"] is not None
            else f"some model was still loaded after {args.idle_wait:.0f} s")  # fmt: skip
    lines = ["# serve benchmark: switch", "", f"`{args.server_label}` at {args.url}; {len(rows)} requests one at a "
             f"time over {', '.join(sorted({r['model'] for r in rows}))}, input {args.input_len} / output "
             f"{args.output_len} tokens; states at the start: {s['states_at_start']}.", "",
             f"- cold TTFT (the switch, load included): {ms(s['cold_ttft_ms'])}; the server's load: "
             + ("-" if not s["load_s"]["n"] else f"p50 {s['load_s']['p50']:.2f} s, max {s['load_s']['max']:.2f} s"),
             f"- warm TTFT: {ms(s['warm_ttft_ms'])}",
             f"- resident memory: {mb(s['rss_start_mb'])} MB at the start, {mb(s['rss_peak_mb'])} MB at most, {idle}",
             "", "| # | model | cold | TTFT ms | load s | RSS before MB | RSS after MB | loaded after |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ttft = f"{r['ttft_ms']:.0f}" if r["ok"] else f"failed: {r['error']}"
        load = "-" if r["load_s"] is None else f"{r['load_s']:.2f}"
        lines.append(
            f"| {r['index']} | {r['model']} | {'yes' if r['cold'] else 'no'} | {ttft} | {load} | "
            f"{mb(r['rss_before_mb'])} | {mb(r['rss_after_mb'])} | {', '.join(r['loaded_after']) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def run_switch(args: argparse.Namespace) -> Path:
    """The switch workload against `--url`: the run folder (manifest, rows, summary, report)."""
    seed = args.seed if args.seed is not None else 0
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    args = argparse.Namespace(**{**vars(args), "input_len": args.input_len or 32, "output_len": args.output_len or 16})
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as client:
        listed = [str(c["id"]) for c in client.get("/v1/models").json().get("data") or []]
        models = args.request_models.split(",") if args.request_models else listed
        if not models:
            raise ValueError(f"{args.url}/v1/models lists no model; name them with --request-models")
        counter = TokenCounter(args.tokenizer, client, models[0])
        rng = random.Random(f"{seed}-switch")
        count = args.num_prompts or 2 * len(models)
        texts = [fit_text(counter, rng, args.input_len)[0] for _ in range(count)]
        config = {"workload": "switch", "url": args.url, "models": models, "num_prompts": count,
                  "input_len": args.input_len, "output_len": args.output_len, "idle_wait_s": args.idle_wait,
                  "endpoint": args.endpoint, "seed": seed, "server_label": args.server_label,
                  "prompt_token_source": counter.source}  # fmt: skip
        run = Run.create(args.output_dir, "switch", config)
        result = asyncio.run(drive_switch(args, models, texts))
        _finish_rows(result["rows"], counter)
    summary = switch_summary(result)
    run.save_raw(result["rows"])
    run.save_summary(summary)
    cold = summary["cold_ttft_ms"]
    path = run.finish(switch_report(args, summary, result["rows"]), model=",".join(models), backend=args.server_label,
                      headline=("cold_ttft_p50_ms", cold["p50"] if cold["n"] else float("nan"), "ms"))  # fmt: skip
    print(f"switch: {summary['requests_completed']}/{summary['requests_sent']} ok, {summary['cold_requests']} cold, "
          f"cold TTFT p50 {cold['p50'] if cold['n'] else float('nan'):.0f} ms, RSS {summary['rss_start_mb']} -> "
          f"{summary['rss_peak_mb']} -> {summary['rss_after_idle_unload_mb']} MB -> {path}", flush=True)  # fmt: skip
    return path

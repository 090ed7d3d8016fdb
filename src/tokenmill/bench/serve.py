"""`tokenmill bench serve`: a streaming load generator against any OpenAI-compatible server.

Metrics follow ../shared/docs/BENCHMARKING.md (as `vllm bench serve` defines them), measured at the client on a
monotonic clock: TTFT (sent -> first text chunk), E2E (sent -> last text chunk), ITL (gaps between text chunks,
pooled), TPOT ((E2E - TTFT) / (output tokens - 1)), throughputs over the wall duration, goodput (requests meeting
every SLO / duration). Arrivals are Poisson at `--request-rate` (inf = all at once), optionally capped by
`--max-concurrency`. Every request has a timeout and the run has a bound; failures become rows, never exceptions.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.flops import FORMULA, report_rows, run_flops
from tokenmill.bench.plots import cdf_plot
from tokenmill.bench.prompts import TokenCounter, fit_text
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run

INF = math.inf
# Per-workload defaults (BENCHMARKING.md); explicit flags override them.
WORKLOADS: dict[str, dict[str, Any]] = {
    "baseline": {"num_prompts": 10, "request_rate": INF, "max_concurrency": 1},
    "continuous_batching": {"num_prompts": 32, "request_rate": 4.0},
    "burst": {"num_prompts": 48, "request_rate": INF},
    "chunked_prefill": {"num_prompts": 48, "request_rate": 6.0, "long_fraction": 0.75},
    "prefix_caching": {"num_prompts": 48, "request_rate": 8.0, "prefix_len": 1024},
    "custom": {"num_prompts": 32, "request_rate": INF},
    "agent": {},  # turns of growing conversations (bench/agent.py), its own flags
    "embed": {},  # /v1/embeddings requests (bench/embed.py)
    "switch": {},  # one request at a time over the models of one server: cold loads, memory (bench/switch.py)
}
LONG_FACTOR = 4  # chunked_prefill: a long prompt is LONG_FACTOR x input-len tokens
CONTEXT_MARGIN = 8  # tokens kept free of the context when scaling prompts (chat templates, BOS)
SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass
class Plan:
    workload: str
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    input_len: int
    output_len: int
    long_fraction: float = 0.0
    long_len: int = 0
    prefix_len: int = 0


def make_plan(args: argparse.Namespace, workload: str, max_model_len: int | None) -> Plan:
    """The workload's defaults, overridden by flags given, prompts scaled to fit `max_model_len` when known."""
    d = WORKLOADS[workload]

    def pick(name: str, default: Any) -> Any:
        given = getattr(args, name, None)
        return given if given is not None else d.get(name, default)

    n_in = pick("input_len", 128)
    plan = Plan(workload, pick("num_prompts", 32), float(pick("request_rate", INF)), pick("max_concurrency", None),
                n_in, pick("output_len", 128), d.get("long_fraction", 0.0),
                LONG_FACTOR * n_in if d.get("long_fraction") else 0, pick("prefix_len", 0))  # fmt: skip
    if max_model_len:
        room = max(1, max_model_len - plan.output_len - CONTEXT_MARGIN)
        plan.input_len = min(plan.input_len, room)
        plan.long_len = min(plan.long_len, room)
        plan.prefix_len = max(0, min(plan.prefix_len, room - plan.input_len))
    if not (plan.request_rate > 0 and plan.num_prompts > 0 and plan.input_len > 0 and plan.output_len > 0):
        raise ValueError(f"request-rate, num-prompts, input-len and output-len must be positive: {plan}")
    if plan.max_concurrency is not None and plan.max_concurrency < 1:
        raise ValueError(f"max-concurrency must be >= 1, got {plan.max_concurrency}")
    return plan


def parse_goodput(spec: str | None) -> dict[str, float]:
    """'ttft:500,tpot:50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for part in filter(None, (spec or "").split(",")):
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput item {part!r}: expected NAME:MS with NAME in {', '.join(SLO_KEYS)}")
        slos[key] = float(value)
    return slos


def build_prompts(plan: Plan, counter: TokenCounter, seed: int) -> list[tuple[str, str, int]]:
    """[(kind, text, expected prompt tokens)] for the plan, the same for the same seed."""
    rng = random.Random(f"{seed}-prompts")
    prefix, prefix_n = fit_text(counter, rng, plan.prefix_len) if plan.prefix_len else ("", 0)
    long_ids = set(rng.sample(range(plan.num_prompts), round(plan.long_fraction * plan.num_prompts)))
    prompts = []
    for i in range(plan.num_prompts):
        kind, n = ("long", plan.long_len) if i in long_ids else ("short", plan.input_len)
        text, got = fit_text(counter, rng, n)
        if prefix:
            kind, text, got = "prefixed", f"{prefix} {text}", got + prefix_n
        prompts.append((kind, text, got))
    return prompts


def _body(args: argparse.Namespace, text: str, output_len: int, index: int = 0) -> dict[str, Any]:
    """Request `index`'s body: its `model` is --model, or with --request-models the index-th of those in turn (LoRA
    adapters or models of one server)."""
    names = args.request_models.split(",") if getattr(args, "request_models", None) else [args.model]
    body: dict[str, Any] = {"model": names[index % len(names)], "max_tokens": output_len, "stream": True,
                            "stream_options": {"include_usage": True}, **sampling(args)}  # fmt: skip
    if not getattr(args, "no_ignore_eos", False):
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The requests' sampling fields: greedy by default; with --temperature, a draw with top_p (1 sent as well, where
    a server has its own default), and top_k / min_p where given (fields beyond OpenAI's, which vLLM and llama-server
    take: llama-server applies its own top-k 40 and min-p 0.05 unless they come as 0)."""
    fields: dict[str, Any] = {"temperature": args.temperature}
    if args.temperature > 0:
        fields["top_p"] = args.top_p
        fields.update({name: getattr(args, name) for name in ("top_k", "min_p") if getattr(args, name) is not None})
    return fields


async def send(client: httpx.AsyncClient, args: argparse.Namespace, body: dict[str, Any], row: dict[str, Any],
               t0: float, timeout: float) -> None:  # fmt: skip
    """One streamed request; fills `row` (ok/error, timings in ms, tokens). Never raises except on cancel."""
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    stamps: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None  # llama-server's per-request figures
    start = time.monotonic()
    row.update(sent=True, start_s=start - t0)
    try:
        async with asyncio.timeout(timeout), client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"in-stream error: {str(obj['error'])[:300]}")
                usage = obj.get("usage") or usage
                timings = obj.get("timings") or timings
                for choice in obj.get("choices") or []:
                    piece = (
                        choice.get("text") if args.endpoint != "chat" else (choice.get("delta") or {}).get("content")
                    )
                    if piece:
                        stamps.append(time.monotonic())
                        pieces.append(piece)
        if not stamps:
            raise RuntimeError("no text was streamed")
    except TimeoutError:
        row.update(ok=False, error=f"timed out after {timeout}s", end_s=time.monotonic() - t0)
        return
    except Exception as e:
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500], end_s=time.monotonic() - t0)
        return
    row.update(ok=True, error=None, end_s=time.monotonic() - t0, chunks=len(stamps), text="".join(pieces),
               ttft_ms=(stamps[0] - start) * 1e3, e2e_ms=(stamps[-1] - start) * 1e3,
               itl_ms=[(b - a) * 1e3 for a, b in itertools.pairwise(stamps)])  # fmt: skip
    if usage and usage.get("completion_tokens") is not None:
        row.update(output_tokens=int(usage["completion_tokens"]), output_tokens_source="usage")
        row["prompt_tokens"] = int(usage.get("prompt_tokens") or row["prompt_tokens"])
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    row["cached_tokens"] = cached if cached is not None else (timings or {}).get("cache_n")


async def drive(args: argparse.Namespace, plan: Plan, prompts: list[tuple[str, str, int]], seed: int,
                on_done: Callable[[], None] = lambda: None) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """Send every prompt (Poisson arrivals, optional concurrency cap) within the run bound; rows + duration (s)."""
    rng = random.Random(f"{seed}-arrivals")
    arrivals, at = [], 0.0
    for _ in prompts:
        arrivals.append(at)
        at += 0.0 if math.isinf(plan.request_rate) else rng.expovariate(plan.request_rate)
    rows: list[dict[str, Any]] = [
        {"index": i, "kind": k, "sent": False, "ok": False, "error": None, "prompt_tokens_expected": n,
         "prompt_tokens": n, "output_tokens": None, "output_tokens_source": None}
        for i, (k, _, n) in enumerate(prompts)
    ]  # fmt: skip
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:  # fmt: skip

        async def one(i: int) -> None:
            body = _body(args, prompts[i][1], plan.output_len, i)
            if sem is None:
                await send(client, args, body, rows[i], t0, args.timeout)
            else:
                async with sem:
                    await send(client, args, body, rows[i], t0, args.timeout)
            on_done()

        async def dispatch() -> None:
            tasks = []
            for i, arrival in enumerate(arrivals):
                delay = t0 + arrival - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)

        try:
            async with asyncio.timeout(args.max_duration):
                await dispatch()
        except TimeoutError:
            pass
    now = time.monotonic() - t0
    for row in rows:
        if row["sent"] and "end_s" not in row:
            row.update(ok=False, error=f"cancelled: run bound of {args.max_duration}s reached", end_s=now)
        elif not row["sent"]:
            row["error"] = f"not sent: run bound of {args.max_duration}s reached"
    ends = [r["end_s"] for r in rows if r["sent"]]
    return rows, max(ends, default=now)


def summarize_rows(rows: list[dict[str, Any]], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    sent = [r for r in rows if r["sent"]]
    ok = [r for r in sent if r["ok"]]
    dur = max(duration, 1e-9)
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    summary: dict[str, Any] = {
        "requests_sent": len(sent), "requests_completed": len(ok), "requests_errors": len(sent) - len(ok),
        "requests_not_sent": len(rows) - len(sent), "duration_s": duration, "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens, "request_throughput": len(ok) / dur, "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": summarize([r["ttft_ms"] for r in ok]), "tpot_ms": summarize([r["tpot_ms"] for r in ok
                                                                                if r["tpot_ms"] is not None]),
        "itl_ms": summarize([x for r in ok for x in r["itl_ms"]]), "e2e_ms": summarize([r["e2e_ms"] for r in ok]),
    }  # fmt: skip
    if slos:
        good = [r for r in ok if all(r.get(f"{k}_ms") is None or r[f"{k}_ms"] <= ms for k, ms in slos.items())]
        summary.update(goodput=len(good) / dur, goodput_fraction=len(good) / max(1, len(sent)),
                       goodput_slo_ms=slos)  # fmt: skip
    return summary


def _finish_rows(rows: list[dict[str, Any]], counter: TokenCounter) -> None:
    """Output tokens without a usage chunk (tokenizer count, else chunk count) and TPOT; drop the text."""
    for r in rows:
        text = r.pop("text", None)
        if not r["ok"]:
            r.setdefault("itl_ms", [])
            r.update(ttft_ms=None, e2e_ms=None, tpot_ms=None)
            continue
        if r["output_tokens"] is None:
            n = len(counter.encode(text or "")) if counter.source != "words" else 0
            src = counter.source if n else "chunks"
            r.update(output_tokens=n or r["chunks"], output_tokens_source=src)
        n = r["output_tokens"]
        r["tpot_ms"] = (r["e2e_ms"] - r["ttft_ms"]) / (n - 1) if n > 1 else None


def render_report(plan: Plan, args: argparse.Namespace, s: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return f"{x:.2f}" if isinstance(x, float) else str(x)

    lines = [f"# serve benchmark: {plan.workload}", "",
             f"`{args.server_label}` at {args.url}, model `{args.model}`, endpoint {args.endpoint}; "
             f"{plan.num_prompts} prompts, rate {plan.request_rate} req/s, max concurrency "
             f"{plan.max_concurrency or 'unbounded'}, input {plan.input_len} / output {plan.output_len} tokens"
             + (f", {plan.long_fraction:.0%} long ({plan.long_len})" if plan.long_fraction else "")
             + (f", shared prefix {plan.prefix_len}" if plan.prefix_len else "") + f", seed {args.seed}.", "",
             "| figure | value |", "|---|---|"]  # fmt: skip
    for key in ("requests_sent", "requests_completed", "requests_errors", "requests_not_sent", "duration_s",
                "request_throughput", "output_throughput", "total_token_throughput", "goodput"):  # fmt: skip
        if key in s:
            lines.append(f"| {key} | {f(s[key])} |")
    if "flops" in s:
        lines += report_rows(s["flops"])
    lines += ["", "| latency (ms) | mean | std | p50 | p90 | p99 | n |", "|---|---|---|---|---|---|---|"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = s[key]
        lines.append(f"| {key[:-3].upper()} | " + " | ".join(f(m[k]) for k in ("mean", "std", "p50", "p90", "p99", "n"))
                     + " |")  # fmt: skip
    lines += ["", "![TTFT CDF](plots/ttft_cdf.png) ![ITL CDF](plots/itl_cdf.png)", ""]
    if "flops" in s:
        lines += [f"{FORMULA}, over the completed requests' tokens and the run's duration; the peaks probed here "
                  "before the first run, on as many threads as the server (--probe-threads).", ""]  # fmt: skip
    return "\n".join(lines)


def _model_len(client: httpx.Client, model: str) -> int | None:
    try:
        cards = client.get("/v1/models").json().get("data") or []
        card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
        value = card.get("max_model_len")
        return int(value) if value else None
    except Exception:
        return None


def _progress(total: int, label: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(advance, close): a rich bar on a terminal, a line per quarter otherwise."""
    if sys.stdout.isatty():
        from rich.progress import Progress

        bar = Progress()
        task = bar.add_task(label, total=total)
        bar.start()
        return (lambda: bar.advance(task)), bar.stop
    done = [0]

    def advance() -> None:
        done[0] += 1
        if done[0] == total or done[0] % max(1, total // 4) == 0:
            print(f"{label}: {done[0]}/{total} requests finished", flush=True)

    return advance, lambda: None


def run_workload(args: argparse.Namespace, workload: str) -> Path:
    seed = args.seed if args.seed is not None else 0
    slos = parse_goodput(args.goodput)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as client:
        max_len = _model_len(client, args.model)
        counter = TokenCounter(args.tokenizer, client, args.model)
        plan = make_plan(args, workload, max_len)
        prompts = build_prompts(plan, counter, seed)
        warm_plan = Plan(**{**asdict(plan), "num_prompts": args.warmup, "request_rate": INF, "max_concurrency": 1})
        warm = build_prompts(warm_plan, counter, seed + 10_000) if args.warmup > 0 else []
        config = {**asdict(plan), "request_rate": "inf" if math.isinf(plan.request_rate) else plan.request_rate,
                  "url": args.url, "model": args.model, "endpoint": args.endpoint, "seed": seed,
                  "goodput_slo_ms": slos, "server_label": args.server_label, "server_max_model_len": max_len,
                  "prefix_len_requested": WORKLOADS[workload].get("prefix_len", 0) if args.prefix_len is None
                  else args.prefix_len, "long_factor": LONG_FACTOR if plan.long_fraction else None,
                  "prompt_token_source": counter.source, "ignore_eos": not args.no_ignore_eos,
                  "request_timeout_s": args.timeout, "max_duration_s": args.max_duration,
                  "warmup": args.warmup, "warmup_excluded": args.warmup > 0, "sampling": sampling(args)}  # fmt: skip
        run = Run.create(args.output_dir, workload, config)
        if warm:
            wrows, _ = asyncio.run(drive(args, warm_plan, warm, seed + 10_000))
            run.manifest["warmup_errors"] = sum(1 for r in wrows if r["sent"] and not r["ok"])
        advance, close = _progress(len(prompts), f"serve {workload}")
        try:
            rows, duration = asyncio.run(drive(args, plan, prompts, seed, advance))
        finally:
            close()
        _finish_rows(rows, counter)
    summary = {"workload": workload, **summarize_rows(rows, duration, slos)}
    if getattr(args, "flops_basis", None):
        summary["flops"] = run_flops(args.flops_basis, summary)
    run.save_raw(rows)
    run.save_summary(summary)
    ok = [r for r in rows if r["ok"]]
    cdf_plot(run.plot_path("ttft_cdf.png"), {"": [r["ttft_ms"] for r in ok]}, "ms", f"TTFT CDF ({workload})",
             "fraction of samples")  # fmt: skip
    cdf_plot(run.plot_path("itl_cdf.png"), {"": [x for r in ok for x in r["itl_ms"]]}, "ms", f"ITL CDF ({workload})",
             "fraction of samples")  # fmt: skip
    path = run.finish(render_report(plan, args, summary), headline=("output_throughput", summary["output_throughput"],
                      "tok/s"), model=args.model, backend=args.server_label)  # fmt: skip
    print(f"{workload}: {summary['requests_completed']}/{summary['requests_sent']} ok, "
          f"{summary['output_throughput']:.1f} output tok/s, TTFT p50 {summary['ttft_ms']['p50']:.1f} ms -> {path}",
          flush=True)  # fmt: skip
    return path

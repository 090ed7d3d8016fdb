"""Offline throughput: every prompt submitted at once, run to completion through the offline engine."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.flops import FORMULA, compute_peaks, flops_summary, matmul_params, report_rows
from tokenmill.bench.latency import peak_rss_mb
from tokenmill.bench.plots import cdf_plot
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run
from tokenmill.metrics import StepStats
from tokenmill.progress import progress


def measure(llm: Any, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    from tokenmill import SamplingParams

    rng = random.Random(seed)
    vocab = llm.loaded.config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]} for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    rows = []
    for i, o in enumerate(outs):
        m = o.metrics
        assert m is not None
        rows.append(
            {
                "request": i,
                "prompt_tokens": len(o.prompt_token_ids),
                "output_tokens": len(o.outputs[0].token_ids),
                "ttft_ms": m.ttft_ms,
                "e2e_ms": ((m.last_token_time or start) - m.arrival_time) * 1000,
            }
        )
    generated = sum(r["output_tokens"] for r in rows)
    prompt_total = sum(r["prompt_tokens"] for r in rows)
    stats = llm.engine.stats
    return {
        "rows": rows,
        "duration_s": elapsed,
        "requests_per_sec": num_prompts / elapsed,
        "output_tokens_per_sec": generated / elapsed,
        "decode_tokens_per_sec": _decode_rate(stats.recent_steps, num_prompts),
        "total_tokens_per_sec": (generated + prompt_total) / elapsed,
        "mean_batch_size": stats.mean_batch_size,
        "max_batch_size": stats.max_batch_size,
        "preemptions": stats.num_preemptions,
        "ttft_ms": summarize([r["ttft_ms"] for r in rows]),
    }


def _decode_rate(steps: Iterable[StepStats], batch: int) -> float | None:
    """Decode tok/s at the full batch: the steps in which all `batch` requests decoded and nothing else ran, their
    tokens over their time (None: no such step)."""
    full = [s for s in steps if s.batch_size == batch and s.num_tokens == s.num_decode_tokens]
    seconds = sum(s.duration_s for s in full)
    return sum(s.num_decode_tokens for s in full) / seconds if seconds > 0 else None


def run_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Path:
    from tokenmill import LLM

    llm = LLM(args.model, **engine_kwargs)
    config = {
        "model": str(llm.loaded.path),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "engine": engine_kwargs,
        "dtype": str(llm.loaded.dtype),
    }
    run = Run.create(args.output_dir, "throughput", config)
    if args.warmup:
        measure(llm, min(2, args.num_prompts), args.input_len, min(4, args.output_len), args.seed + 1)
    with progress(f"bench throughput: {args.num_prompts} prompts"):
        result = measure(llm, args.num_prompts, args.input_len, args.output_len, args.seed)
    rows = result.pop("rows")
    run.save_raw(rows)
    cdf_plot(
        run.plot_path("latency_cdf.png"),
        {"TTFT": [r["ttft_ms"] for r in rows], "E2E": [r["e2e_ms"] for r in rows]},
        "ms",
        "offline throughput: per-request latency",
    )
    result.update(backend="tokenmill", peak_rss_mb=peak_rss_mb())
    result["flops"] = _flops(llm, rows, result["duration_s"])
    run.save_summary(result)
    report = (
        f"# throughput: {Path(config['model']).name}, {args.num_prompts} prompts x {args.input_len} in / "
        f"{args.output_len} out\n\n| measure | value |\n|---|---|\n"
        f"| output tok/s | {result['output_tokens_per_sec']:.1f} |\n"
        f"| decode tok/s (every prompt in) | {result['decode_tokens_per_sec'] or 0:.1f} |\n"
        f"| total tok/s | {result['total_tokens_per_sec']:.1f} |\n"
        f"| requests/s | {result['requests_per_sec']:.3f} |\n"
        f"| mean / max batch | {result['mean_batch_size']:.1f} / {result['max_batch_size']} |\n"
        f"| duration s | {result['duration_s']:.1f} |\n"
        + "\n".join(report_rows(result["flops"]))
        + f"\n\n{FORMULA}. The peaks were probed after the run.\n\n"
        f"Command: `{run.manifest['command']}`\n"
    )
    print(report)
    return run.finish(
        report,
        ("output tok/s", result["output_tokens_per_sec"], "tok/s"),
        config["model"],
        "tokenmill",
        warmup_excluded=bool(args.warmup),
    )


def _flops(llm: Any, rows: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """The run's model GFLOPS and its share of each arithmetic peak, probed now on the model's threads."""
    body, head = matmul_params(str(llm.loaded.path))
    prompt, output = sum(r["prompt_tokens"] for r in rows), sum(r["output_tokens"] for r in rows)
    return flops_summary(body, head, prompt, output, len(rows), duration_s, compute_peaks())


def add_throughput_parser(sub: Any, engine_args: Any) -> None:
    p = sub.add_parser("throughput", help="offline throughput: all prompts at once")
    engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output-dir", default="bench-results")

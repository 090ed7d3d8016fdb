"""Single-stream latency, the llama-bench equivalent: prompt processing (pp N) and text generation (tg N)
tokens/s with their std over trials, achieved weight-read bandwidth (weight bytes x tg tok/s), peak RSS, and the
p50 and p90 over every decode token of the trials of its step's time over the tokens that step gave (a decode run
gives several: `num_scheduler_steps`), with the share of the probe at the p50.

Prefix caching is off so every trial really computes its prompt; prompts are random token ids (seeded).
"""

from __future__ import annotations

import argparse
import random
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.bandwidth import read_bandwidth_gb_s
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run
from tokenmill.progress import progress

if TYPE_CHECKING:
    from tokenmill import LLM


def weight_bytes(llm: Any) -> int:
    """Bytes of weights one decode step reads (see `models.linear.weight_bytes`)."""
    from tokenmill.models.linear import weight_bytes as model_weight_bytes

    return model_weight_bytes(llm.loaded.model)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(
    llm: Any,
    prompt_tokens: int,
    gen_tokens: int,
    repeat: int,
    warmup: int,
    seed: int,
    sampling: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per trial (warmups included, flagged) with pp and tg tokens/s. `sampling`: SamplingParams fields
    (temperature, top_k, top_p; greedy without them), each trial's draws seeded from `seed` (its prompt too)."""
    rng, seeds = random.Random(seed), random.Random(seed + 1)  # the prompts as before sampling had a seed
    vocab = llm.loaded.config.vocab_size
    rows = []
    with progress("bench latency: trials", total=warmup + repeat) as advance:
        for trial in range(warmup + repeat):
            params = {"temperature": 0, **(sampling or {}), "seed": seeds.randrange(2**31)}
            rows.append(_trial(llm, rng, vocab, prompt_tokens, gen_tokens, trial - warmup, params))
            advance()
    return rows


def _trial(
    llm: Any, rng: random.Random, vocab: int, prompt_tokens: int, gen_tokens: int, trial: int, sampling: dict[str, Any]
) -> dict[str, Any]:
    from tokenmill import SamplingParams

    prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    params = SamplingParams(**sampling, max_tokens=gen_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    m = out.metrics
    assert m is not None and m.prefill_ms is not None
    return {
        "trial": trial,
        "warmup": trial < 0,
        "sampling": sampling,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": len(out.outputs[0].token_ids),
        "prefill_ms": m.prefill_ms,
        "pp_tokens_per_sec": prompt_tokens / (m.prefill_ms / 1000),
        "tg_tokens_per_sec": m.decode_tokens_per_sec or 0.0,
        "token_ms": m.token_ms,
    }


def run_latency(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Path:
    from tokenmill import LLM

    engine_kwargs = {**engine_kwargs, "enable_prefix_caching": False}
    llm = LLM(args.model, **engine_kwargs)
    config = {
        "model": str(llm.loaded.path),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "seed": args.seed,
        "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
        "engine": engine_kwargs,
        "dtype": str(llm.loaded.dtype),
        "device": str(llm.loaded.device),
    }
    run = Run.create(args.output_dir, "latency", config)
    # the memory's read bandwidth before the warmup trials (which then warm the model again; with --warmup 0 the
    # first trial starts cold) and after the measured ones: a shared host's can change ~1.7x within seconds (Zen 4:
    # ~31 <-> ~53 GB/s), so the trials are judged against the mean of the two around them rather than one
    probes = [read_bandwidth_gb_s(device=str(llm.loaded.device))]
    rows = measure(llm, args.prompt_tokens, args.gen_tokens, args.repeat, args.warmup, args.seed, config["sampling"])
    probes.append(read_bandwidth_gb_s(device=str(llm.loaded.device)))
    probe = sum(probes) / 2
    measured = [r for r in rows if not r["warmup"]]
    wbytes = weight_bytes(llm)
    pp = summarize([r["pp_tokens_per_sec"] for r in measured])
    tg = summarize([r["tg_tokens_per_sec"] for r in measured])
    # every decode token of the trials: on a shared host a phase of slow steps (another tenant, a lost core) moves
    # the mean, and the median shows what the code does when it has the machine
    steps = summarize([t for r in measured for t in r["token_ms"]])
    summary = {
        "backend": "tokenmill",
        f"pp{args.prompt_tokens}_tokens_per_sec": pp,
        f"tg{args.gen_tokens}_tokens_per_sec": tg,
        "weight_bytes": wbytes,
        "achieved_gb_per_sec": wbytes * tg["mean"] / 1e9,
        "token_ms": steps if steps["n"] else None,
        "read_bandwidth_gb_per_sec": probe,
        "probes_gb_per_sec": probes,
        "kernels": _kernel_path(llm),
        "peak_rss_mb": peak_rss_mb(),
    }
    run.save_raw(rows)
    run.save_summary(summary)
    _plot(run, rows)
    report = _report(args, config, summary, run.manifest["command"])
    print(report)
    return run.finish(
        report,
        (f"tg{args.gen_tokens} tok/s", tg["mean"], "tok/s"),
        config["model"],
        "tokenmill",
        warmup_excluded=args.warmup,
    )


def _report(args: argparse.Namespace, config: dict[str, Any], summary: dict[str, Any], command: str) -> str:
    """report.md: the summary's measures as a table, then the trials and the command."""
    pp, tg = summary[f"pp{args.prompt_tokens}_tokens_per_sec"], summary[f"tg{args.gen_tokens}_tokens_per_sec"]
    probe, (before, after), wbytes = (
        summary["read_bandwidth_gb_per_sec"],
        summary["probes_gb_per_sec"],
        summary["weight_bytes"],
    )
    return (
        f"# latency: {Path(config['model']).name} ({config['dtype']}, {config['device']})\n\n"
        "| measure | mean | std |\n|---|---|---|\n"
        f"| pp{args.prompt_tokens} tok/s | {pp['mean']:.1f} | {pp['std']:.1f} |\n"
        f"| tg{args.gen_tokens} tok/s | {tg['mean']:.2f} | {tg['std']:.2f} |\n"
        f"| achieved GB/s (weights x tg) | {summary['achieved_gb_per_sec']:.2f} | |\n"
        f"| read bandwidth probe GB/s (before / after the trials) | {probe:.1f} ({before:.1f} / {after:.1f}) | |\n"
        f"| achieved / probe | {wbytes * tg['mean'] / 1e9 / probe:.0%} | |\n"
        f"{_step_rows(summary['token_ms'], wbytes, probe)}"
        f"| peak RSS MB | {summary['peak_rss_mb']:.0f} | |\n\n"
        f"{args.repeat} trials after {args.warmup} warmup (excluded); CPU kernels: {summary['kernels']}. "
        f"Command: `{command}`\n"
    )


def _step_rows(steps: dict[str, float] | None, wbytes: int, probe: float) -> str:
    """The report's rows for the decode tokens' p50 and p90 (none with fewer than two tokens a trial)."""
    if not steps or not steps["n"]:
        return ""
    share = wbytes / (steps["p50"] / 1000) / 1e9 / probe
    return (f"| decode ms a token: p50 / p90 of {steps['n']} | {steps['p50']:.2f} / {steps['p90']:.2f} | |\n"
            f"| achieved / probe at the p50 | {share:.0%} | |\n")  # fmt: skip


def _kernel_path(llm: LLM) -> str:
    """The CPU kernel variant the model runs on, or why none."""
    from tokenmill import kernels

    if llm.loaded.device.type != "cpu":
        return f"none (the model runs on {llm.loaded.device})"
    return str(kernels.status()["kernels"])


def _plot(run: Run, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if not r["warmup"]]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key, title in zip(axes, ("pp_tokens_per_sec", "tg_tokens_per_sec"), ("prompt processing", "generation")):
        ax.bar(range(len(measured)), [r[key] for r in measured])
        ax.set_title(f"{title} (tok/s per trial)")
        ax.set_xlabel("trial")
    fig.tight_layout()
    fig.savefig(run.plot_path("latency_trials.png"), dpi=100)
    plt.close(fig)


def add_latency_parser(sub: Any, engine_args: Any) -> None:
    p = sub.add_parser("latency", help="single-stream pp/tg tokens/s (llama-bench style)")
    engine_args(p)
    p.add_argument("--prompt-tokens", type=positive_int, default=512)
    p.add_argument("--gen-tokens", type=positive_int, default=128)
    p.add_argument("--repeat", type=positive_int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above, each trial draws, seeded")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (1: off)")
    p.add_argument("--output-dir", default="bench-results")

"""`tokenmill bench sweep --experiment ...`: the experiments that show what each mechanism buys.

- threads:       pp/tg tokens/s for 1..N torch threads (where CPU decode stops scaling)
- kv_cache:      `--kv-cache none` (recompute, O(N^2)) vs paged (O(N)) over growing output lengths
- prompt_length: prefill time for growing prompts with the output length held fixed (warmup + trials each)
- quantization:  each weight mode that exists (today: none)
- switches:      each engine switch on/off on an offline workload (batching, chunked prefill, prefix caching, kv store)
- spec_decode:   batch-1 decode with speculation (prompt lookup, or the draft model --speculative-model names),
                 k = 0 (off), 2, 4, 6 drafts, on passages of --grounded-text: by default each followed by its
                 opening again (input-grounded), or with --no-repeat the passage alone (plain continuation)
- structured_output: a decode step with and without a JSON-schema grammar at each --batch-sizes, and grammar
                 compile time (bench/structured.py)
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.latency import measure as measure_latency
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run
from tokenmill.bench.structured import run as run_structured
from tokenmill.bench.throughput import measure as measure_throughput
from tokenmill.config import QUANTIZATION_MODES
from tokenmill.progress import progress

EXPERIMENTS = ("threads", "kv_cache", "prompt_length", "quantization", "switches", "spec_decode", "structured_output")
SWITCHES: list[tuple[str, dict[str, Any]]] = [
    ("baseline (defaults)", {}),
    ("batching=static", {"batching": "static"}),
    ("no chunked prefill", {"enable_chunked_prefill": False}),
    ("no prefix caching", {"enable_prefix_caching": False}),
    ("kv_cache=contiguous", {"kv_cache": "contiguous"}),
]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _threads(args: argparse.Namespace, kw: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from tokenmill import LLM

    llm = LLM(args.model, **{**kw, "enable_prefix_caching": False})
    rows = []
    for n in range(1, (os.cpu_count() or 1) + 1):
        torch.set_num_threads(n)
        trials = [
            r
            for r in measure_latency(llm, args.prompt_tokens, args.gen_tokens, args.trials, 1, args.seed)
            if not r["warmup"]
        ]
        rows.append(
            {
                "threads": n,
                "pp_tokens_per_sec": summarize([r["pp_tokens_per_sec"] for r in trials])["mean"],
                "tg_tokens_per_sec": summarize([r["tg_tokens_per_sec"] for r in trials])["mean"],
            }
        )
    return rows


def _kv_cache(args: argparse.Namespace, kw: dict[str, Any]) -> list[dict[str, Any]]:
    from tokenmill import LLM, SamplingParams

    rows = []
    for mode in ("none", "paged"):
        llm = LLM(args.model, **{**kw, "kv_cache": mode, "enable_prefix_caching": False})
        prompt = [random.Random(args.seed).randrange(llm.loaded.config.vocab_size) for _ in range(args.prompt_tokens)]
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        for n in _ints(args.gen_lengths):
            start = time.perf_counter()
            out = llm.generate(
                [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            )
            elapsed = time.perf_counter() - start
            m = out[0].metrics
            assert m is not None
            rows.append(
                {
                    "kv_cache": mode,
                    "gen_tokens": n,
                    "total_s": elapsed,
                    "tg_tokens_per_sec": m.decode_tokens_per_sec or 0.0,
                }
            )
    return rows


def _prompt_length(args: argparse.Namespace, kw: dict[str, Any]) -> list[dict[str, Any]]:
    from tokenmill import LLM

    llm = LLM(args.model, **{**kw, "enable_prefix_caching": False})
    rows = []
    for p in _ints(args.prompt_lengths):
        trials = [r for r in measure_latency(llm, p, args.gen_tokens, args.trials, 1, args.seed) if not r["warmup"]]
        prefill = summarize([r["prefill_ms"] for r in trials])
        rows.append(
            {
                "prompt_tokens": p,
                "gen_tokens": args.gen_tokens,
                "prefill_ms_mean": prefill["mean"],
                "prefill_ms_std": prefill["std"],
                "tg_tokens_per_sec": summarize([r["tg_tokens_per_sec"] for r in trials])["mean"],
                "trials": len(trials),
            }
        )
    return rows


def _quantization(args: argparse.Namespace, kw: dict[str, Any]) -> list[dict[str, Any]]:
    """pp/tg per weight-only mode; with --quality-text, top-1 agreement and perplexity against `none`."""
    import gc

    from tokenmill import LLM
    from tokenmill.bench.latency import weight_bytes
    from tokenmill.quality import compare, score

    text = Path(args.quality_text).read_text() if args.quality_text else None
    rows, reference = [], None
    for mode in QUANTIZATION_MODES:
        try:
            llm = LLM(args.model, **{**kw, "quantization": mode, "enable_prefix_caching": False})
        except ValueError as e:  # e.g. int4 on a float32 model: reported, not fatal
            rows.append({"quantization": mode, "error": str(e)})
            continue
        trials = [
            r
            for r in measure_latency(llm, args.prompt_tokens, args.gen_tokens, args.trials, 1, args.seed)
            if not r["warmup"]
        ]
        row: dict[str, Any] = {
            "quantization": mode,
            "weight_mb": weight_bytes(llm) / 2**20,
            "tg_tokens_per_sec": summarize([r["tg_tokens_per_sec"] for r in trials])["mean"],
            "pp_tokens_per_sec": summarize([r["pp_tokens_per_sec"] for r in trials])["mean"],
        }
        if text is not None:
            mine = score(llm.loaded, text)
            reference = reference or mine
            q = compare(reference, mine)
            row.update(top1_agreement=q["top1_agreement"], perplexity=q["perplexity"])
        rows.append(row)
        del llm
        gc.collect()
    return [r for r in rows if "error" not in r] + [r for r in rows if "error" in r]


def _switches(args: argparse.Namespace, kw: dict[str, Any]) -> list[dict[str, Any]]:
    from tokenmill import LLM

    rows = []
    for label, change in SWITCHES:
        llm = LLM(args.model, **{**kw, **change})
        r = measure_throughput(llm, args.num_prompts, args.prompt_tokens, args.gen_tokens, args.seed)
        rows.append(
            {
                "config": label,
                "output_tokens_per_sec": r["output_tokens_per_sec"],
                "ttft_ms_p50": r["ttft_ms"]["p50"],
                "mean_batch_size": r["mean_batch_size"],
            }
        )
    return rows


def _spec_decode(args: argparse.Namespace, kw: dict[str, Any]) -> list[dict[str, Any]]:
    """tg tokens/s, draft acceptance and tokens per decode step for each k, the same greedy prompts for all. Single
    decode steps throughout (`num_scheduler_steps` 1): a step is then one pass of the model in every row, where a
    decode run would count four passes as one step in the k = 0 row (drafted rows never run)."""
    from tokenmill import LLM, SamplingParams

    prompts = _grounded_prompts(args, LLM(args.model, **kw).tokenizer)
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    rows = []
    for k in _ints(args.spec_k):
        proposer = kw.get("speculative_model") or "ngram"  # --speculative-model names a draft model instead
        spec = {"speculative_model": proposer, "num_speculative_tokens": k} if k else {"speculative_model": None}
        llm = LLM(args.model, **{**kw, **spec, "enable_prefix_caching": False, "num_scheduler_steps": 1})
        llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(temperature=0, max_tokens=4))  # warmup
        tg, drafted, kept, per_step = [], 0, 0, []
        for ids in prompts:
            steps = llm.engine.stats.num_steps
            m = llm.generate([{"prompt_token_ids": ids}], params)[0].metrics
            assert m is not None
            tg.append(m.decode_tokens_per_sec or 0.0)
            drafted, kept = drafted + m.num_draft_tokens, kept + m.num_accepted_tokens
            decode_steps = llm.engine.stats.num_steps - steps - 1  # the first step is the prefill
            per_step.append((m.num_generated_tokens - 1) / max(decode_steps, 1))
        rate = kept / drafted if drafted else 0.0
        rows.append({"k": k, "tg_tokens_per_sec": summarize(tg)["mean"], "acceptance_rate": rate,
                     "tokens_per_decode_step": summarize(per_step)["mean"], "prompts": len(prompts)})  # fmt: skip
    return rows


def _grounded_prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """--num-prompts passages of --prompt-tokens from --grounded-text, each followed by its first quarter again:
    a continuation that can copy from its input, as editing or quoting does."""
    if not args.grounded_text:
        raise ValueError("--experiment spec_decode needs --grounded-text FILE (a text to quote from)")
    ids = tokenizer.encode(Path(args.grounded_text).read_text(), add_special_tokens=False)
    n = args.prompt_tokens
    if len(ids) < 2 * n:
        raise ValueError(f"--grounded-text has {len(ids)} tokens; --prompt-tokens {n} needs at least {2 * n}")
    starts = random.Random(args.seed).sample(range(len(ids) - n), args.num_prompts)
    repeat = 0 if args.no_repeat else n // 4
    return [ids[s : s + n] + ids[s : s + repeat] for s in starts]


RUNNERS = {
    "threads": _threads,
    "kv_cache": _kv_cache,
    "prompt_length": _prompt_length,
    "quantization": _quantization,
    "switches": _switches,
    "spec_decode": _spec_decode,
    "structured_output": run_structured,
}
PLOTS = {
    "threads": ("threads", ["pp_tokens_per_sec", "tg_tokens_per_sec"]),
    "kv_cache": ("gen_tokens", ["total_s"]),
    "prompt_length": ("prompt_tokens", ["prefill_ms_mean"]),
    "quantization": ("quantization", ["tg_tokens_per_sec"]),
    "switches": ("config", ["output_tokens_per_sec"]),
    "spec_decode": ("k", ["tg_tokens_per_sec"]),
    "structured_output": ("batch", ["step_ms_free", "step_ms_constrained"]),
}


def run_sweep(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Path:
    config = {k: v for k, v in vars(args).items() if k not in ("func",)} | {"engine": engine_kwargs}
    run = Run.create(args.output_dir, f"sweep_{args.experiment}", config)
    with progress(f"bench sweep: {args.experiment}"):
        rows = RUNNERS[args.experiment](args, engine_kwargs)
    run.save_raw(rows)
    run.save_summary(rows)
    _plot(run, args.experiment, rows)
    header = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"# sweep: {args.experiment}\n", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += [
        "| " + " | ".join(f"{r[h]:.4g}" if isinstance(r.get(h), float) else str(r.get(h, "-")) for h in header) + " |"
        for r in rows
    ]
    report = "\n".join([*lines, "", f"Command: `{run.manifest['command']}`", ""])
    print(report)
    key = PLOTS[args.experiment][1][0]
    return run.finish(report, (key, float(rows[-1][key]), ""), str(args.model or "demo"), "tokenmill")


def _plot(run: Run, experiment: str, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, y_keys = PLOTS[experiment]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    groups = sorted({r.get("kv_cache", "") for r in rows})
    for y in y_keys:
        for g in groups:
            sel = [r for r in rows if r.get("kv_cache", "") == g and y in r]
            label = f"{y} {g}".strip()
            if isinstance(sel[0][x_key], str):
                ax.bar([r[x_key] for r in sel], [r[y] for r in sel], label=label)
                ax.tick_params(axis="x", labelrotation=20)
            else:
                ax.plot([r[x_key] for r in sel], [r[y] for r in sel], marker="o", label=label)
    ax.set_xlabel(x_key)
    ax.set_title(f"sweep: {experiment}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run.plot_path(f"sweep_{experiment}.png"), dpi=100)
    plt.close(fig)


def add_sweep_parser(sub: Any, engine_args: Any) -> None:
    p = sub.add_parser("sweep", help="experiments: " + ", ".join(EXPERIMENTS))
    engine_args(p)
    p.add_argument("--experiment", choices=EXPERIMENTS, required=True)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--gen-lengths", default="16,32,64,128", help="kv_cache: output lengths")
    p.add_argument("--prompt-lengths", default="32,128,512,1024", help="prompt_length: prompt lengths")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--num-prompts", type=positive_int, default=16, help="switches: prompts per workload")
    p.add_argument("--quality-text", default=None, help="quantization: text for top-1 agreement and perplexity")
    p.add_argument("--grounded-text", default=None, help="spec_decode: the text prompts quote from")
    p.add_argument("--spec-k", default="0,2,4,6", help="spec_decode: drafts per step (0: off)")
    p.add_argument(
        "--no-repeat",
        action="store_true",
        help="spec_decode: prompts are the passages alone (plain continuation), not passage + opening",
    )
    p.add_argument("--batch-sizes", default="1,16", help="structured_output: concurrent requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench-results")

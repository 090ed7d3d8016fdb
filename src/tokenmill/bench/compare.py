"""`tokenmill bench compare`: the same weights and prompts through tokenmill, transformers and llama.cpp.

A backend is `NAME[:VARIANT]`: `llama.cpp:q8_0` runs llama.cpp on a Q8_0 GGUF (variants: the GGUF dtypes;
plain `llama.cpp` matches `--dtype`); `tokenmill:int8` runs tokenmill with `--quantization int8`. Per backend
the table gives whole-request tok/s and TTFT, plus the llama-bench pair: pp (prompt tokens / TTFT) and tg
(tokens after the first / time after the first).
Each backend runs in its own process (`worker.py`), so its memory is its own; the parent samples the child's
RSS every 50 ms for `peak_memory_mib`. A backend that is not installed is reported as such, never a crash.
llama.cpp gets a GGUF of the same weights (converted with `gguf_export.py`, or `--gguf PATH`). A `.gguf` model
runs as it is in every backend (transformers dequantizes it), so tokenmill and llama.cpp read the very same file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.bandwidth import read_bandwidth_gb_s
from tokenmill.bench.stats import summarize
from tokenmill.bench.store import Run
from tokenmill.progress import progress

BACKENDS = ("tokenmill", "transformers", "llama.cpp")
GGUF_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "auto": "bf16"}


def parse_backends(spec: str, dtype: str, gguf_model: bool = False) -> list[tuple[str, str | None]]:
    """`tokenmill,llama.cpp,llama.cpp:q8_0` -> [("tokenmill", None), ("llama.cpp", "bf16"), ("llama.cpp", "q8_0")].
    With a .gguf model (`gguf_model`) every backend runs that very file: llama.cpp takes no variant."""
    from tokenmill.bench.gguf_export import GGUF_DTYPES as GGUF_VARIANTS
    from tokenmill.config import QUANTIZATION_MODES

    out: list[tuple[str, str | None]] = []
    for item in (b.strip() for b in spec.split(",")):
        if not item:
            continue
        name, _, variant = item.partition(":")
        if name not in BACKENDS:
            raise ValueError(f"--backends {item} unknown; allowed: {', '.join(BACKENDS)} (llama.cpp:VARIANT too)")
        if name == "llama.cpp" and gguf_model:
            if variant:
                raise ValueError(f"--backends {item}: with a .gguf model llama.cpp runs that file; drop :{variant}")
            out.append((name, None))
        elif name == "llama.cpp":
            variant = variant or GGUF_DTYPES.get(dtype, "bf16")
            if variant not in GGUF_VARIANTS:
                raise ValueError(f"--backends {item}: GGUF variant must be one of {', '.join(GGUF_VARIANTS)}")
            out.append((name, variant))
        elif name == "tokenmill" and variant:
            if variant not in QUANTIZATION_MODES:
                raise ValueError(f"--backends {item}: tokenmill variants are {', '.join(QUANTIZATION_MODES)}")
            out.append((name, variant))
        elif variant:
            raise ValueError(f"--backends {item}: transformers takes no variant")
        else:
            out.append((name, None))
    return out


def label(name: str, variant: str | None) -> str:
    return f"{name} {variant}" if variant else name


def worker_env(backend: str) -> dict[str, str]:
    """The environment a backend's worker runs in: tokenmill's own, or for a peer its users' (without the OpenMP
    wait policy tokenmill sets for itself: llama.cpp's OpenMP threads sleeping between a step's many small ops cost
    it ~40% of its tg128 on a Zen 4, as llama-bench shows with OMP_WAIT_POLICY=PASSIVE)."""
    import tokenmill

    env = dict(os.environ)
    if backend != "tokenmill":
        env["TOKENMILL_OMP_DEFAULT"] = "0"
        env.pop("OMP_WAIT_POLICY", None)
        if tokenmill.USER_OMP_WAIT_POLICY is not None:
            env["OMP_WAIT_POLICY"] = tokenmill.USER_OMP_WAIT_POLICY
    return env


def _run_worker(
    backend: str, model: str, spec: dict[str, Any], workdir: Path, timeout: float, tag: str | None = None
) -> dict[str, Any]:
    import psutil

    tag = tag or backend
    spec_path, out_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.result.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.bench.worker",
        "--backend",
        backend,
        "--model",
        model,
        "--spec",
        str(spec_path),
        "--out",
        str(out_path),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=worker_env(backend))
    ps, peak, deadline = psutil.Process(proc.pid), 0, time.monotonic() + timeout
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, ps.memory_info().rss)
        if time.monotonic() > deadline:
            proc.kill()
            return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
        time.sleep(0.05)
    stderr = proc.stderr.read() if proc.stderr else ""
    if not out_path.exists():
        return {"status": "error", "error": (stderr.strip().splitlines() or ["worker died"])[-1]}
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["peak_memory_mib"] = peak / 2**20
    return result


def _rates(runs: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Each run's prefill and decode tokens/s: prompt tokens over TTFT; tokens after the first over the rest."""
    pp = [r["prompt_tokens"] / (r["ttft_ms"] / 1000) for r in runs if r.get("prompt_tokens") and r["ttft_ms"] > 0]
    tg = [
        (r["completion_tokens"] - 1) / (r["generate_time_s"] - r["ttft_ms"] / 1000)
        for r in runs
        if r["completion_tokens"] > 1 and r["generate_time_s"] > r["ttft_ms"] / 1000
    ]
    return pp, tg


def _summarize_rounds(backend: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One backend over every round: the first round's row, with pp and tg the median of the rounds' means
    (and each round's tg) when there were several."""
    failed = next((r for r in results if r.get("status") != "ok"), None)
    row = _summarize_backend(backend, failed or results[0])
    if failed is None and len(results) > 1:
        rounds = [_rates(r["runs"]) for r in results]
        row["tg_by_round"] = [summarize(tg)["mean"] if tg else None for _, tg in rounds]
        for key, i in (("pp_tokens_per_sec", 0), ("tg_tokens_per_sec", 1)):
            means = [summarize(rates[i])["mean"] for rates in rounds if rates[i]]
            row[key] = statistics.median(means) if means else None
        if result_bytes := results[0].get("weight_bytes"):
            row["tg_gb_per_sec"] = result_bytes * row["tg_tokens_per_sec"] / 1e9 if row["tg_tokens_per_sec"] else None
        shares = [_probe_share(r, tg) for r, tg in zip(results, row["tg_by_round"], strict=True)]
        row["probe_share_by_round"] = shares
        row["probe_share"] = statistics.median([s for s in shares if s is not None]) if any(shares) else None
    return row


def _probe_share(result: dict[str, Any], tg: float | None) -> float | None:
    """A run's tg GB/s over the read bandwidth the probes just before and just after it measured (their mean): a
    shared host's bandwidth can change ~1.7x within seconds (another tenant's load; Zen 4: ~31 <-> ~53 GB/s), so a
    run is judged against the memory it had, not one probe taken minutes away."""
    probes, wbytes = result.get("probe_gb_s"), result.get("weight_bytes")
    if not probes or not wbytes or not tg:
        return None
    return wbytes * tg / 1e9 / statistics.mean(probes)


def _summarize_backend(backend: str, result: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"backend": backend, "status": result.get("status")}
    if result.get("status") != "ok":
        row["error"] = result.get("error")
        return row
    runs = result["runs"]
    gen_time = sum(r["generate_time_s"] for r in runs)
    tokens = sum(r["completion_tokens"] for r in runs)
    pp, tg = _rates(runs)
    row.update(
        pp_tokens_per_sec=summarize(pp)["mean"] if pp else None,
        tg_tokens_per_sec=summarize(tg)["mean"] if tg else None,
    )
    row.update(
        load_time_s=result["load_time_s"],
        generate_time_s=gen_time,
        completion_tokens=tokens,
        tokens_per_second=tokens / gen_time if gen_time else 0.0,
        ttft_ms=summarize([r["ttft_ms"] for r in runs])["mean"],
        peak_memory_mib=result.get("peak_memory_mib"),
        text=runs[0]["text"],
    )
    if result.get("weight_bytes") and row["tg_tokens_per_sec"]:
        row["tg_gb_per_sec"] = result["weight_bytes"] * row["tg_tokens_per_sec"] / 1e9
    row["probe_share"] = _probe_share(result, row["tg_tokens_per_sec"])
    return row


def run_compare(args: argparse.Namespace) -> Path:
    from tokenmill.assembly.model import default_model_ref
    from tokenmill.tokenizer import Tokenizer
    from tokenmill.weights import resolve_model
    from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint

    model = str(resolve_model(args.model or default_model_ref()))
    gguf_model = model.lower().endswith(".gguf")
    if gguf_model and args.gguf:
        raise ValueError("--gguf names llama.cpp's file for an HF folder; the model is a .gguf already: drop --gguf")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, not {args.rounds}")
    parsed = parse_backends(args.backends, args.dtype, gguf_model)
    backends = [label(n, v) for n, v in parsed]
    tok = Tokenizer(model, None, GGUFCheckpoint(Path(model)).metadata if gguf_model else None)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(tok.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.num_prompts)]
    config = {
        "model": model,
        "backends": backends,
        "dtype": args.dtype,
        "threads": args.threads,
        "num_prompts": args.num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "gguf": args.gguf,
        "rounds": args.rounds,
    }
    run = Run.create(args.output_dir, "compare", config)
    spec: dict[str, Any] = {
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "n_ctx": args.prompt_tokens + args.max_tokens + 8,
    }
    raw, results, probes = _run_rounds(args, parsed, model, spec, run.path)
    rows = [_summarize_rounds(backend, rs) for backend, rs in results.items()]
    _add_agreement(rows, raw, backends[0])
    config["read_bandwidth_gb_per_sec"], config["probes_gb_per_sec"] = statistics.median(probes), probes
    run.save_raw(raw)
    run.save_summary(rows)
    _plot(run, rows)
    report = _report(rows, config, run.manifest["command"])
    print(report)
    best = max((float(r.get("tokens_per_second", 0.0)) for r in rows if r["backend"] == backends[0]), default=0.0)
    return run.finish(report, (f"{backends[0]} tok/s", best, "tok/s"), model, ",".join(backends))


def _run_rounds(
    args: argparse.Namespace, parsed: list[tuple[str, str | None]], model: str, spec: dict[str, Any], out: Path
) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]], list[float]]:
    """Every backend once per round, in turn (the host's drift hits them alike), each in a worker of its own: the
    runs of every prompt, flat ([{backend, round, prompt, ...}]), each backend's worker results by round, and the
    memory's read bandwidth probes (GB/s). A backend that failed once (its GGUF export or a worker) is not run again.
    A probe comes before the first worker, after each worker, and after each GGUF is made (the export's own memory
    traffic is not the next run's): a worker's result keeps the two probes around it."""
    raw: list[dict[str, Any]] = []
    results: dict[str, list[dict[str, Any]]] = {label(n, v): [] for n, v in parsed}
    ggufs: dict[str, str] = {}
    probes = [read_bandwidth_gb_s()]
    for rnd in range(args.rounds):
        for name, variant in parsed:
            backend = label(name, variant)
            if name == "llama.cpp" and backend not in ggufs:
                try:
                    ggufs[backend] = _gguf(model, args.gguf, out, str(variant))
                except Exception as e:
                    results[backend].append({"status": "error", "error": f"GGUF export failed: {e}"})
                    continue
                probes.append(read_bandwidth_gb_s())
            if any(r.get("status") != "ok" for r in results[backend]):
                continue  # failed in an earlier round
            spec["gguf"] = ggufs.get(backend)
            spec["engine"] = {"quantization": variant} if name == "tokenmill" and variant else {}
            tag = backend.replace(" ", "-") + (f"-round{rnd + 1}" if args.rounds > 1 else "")
            with progress(f"bench compare: {backend}" + (f" (round {rnd + 1})" if args.rounds > 1 else "")):
                result = _run_worker(name, model, spec, out / "raw", args.timeout, tag=tag)
            probes.append(read_bandwidth_gb_s())
            result["probe_gb_s"] = probes[-2:]
            raw += [{"backend": backend, "round": rnd, "prompt": i, **r} for i, r in enumerate(result.get("runs", []))]
            results[backend].append(result)
            print(f"{backend}: {result.get('status')}", file=sys.stderr)
    return raw, results, probes


def _gguf(model: str, given: str | None, out: Path, variant: str) -> str:
    """The GGUF llama.cpp reads: the model itself where it is one, `--gguf`, else the model exported as `variant`."""
    if model.lower().endswith(".gguf"):
        return model
    return given or str(_export(model, out / f"model-{variant}.gguf", variant))


def _add_agreement(rows: list[dict[str, Any]], raw: list[dict[str, Any]], first: str) -> None:
    """Each row's share of greedy tokens equal to the first backend's, on the first prompt of the first round."""
    reference = next((r for r in raw if r["backend"] == first and r["prompt"] == 0), None)
    for row in rows:
        mine = next((r for r in raw if r["backend"] == row["backend"] and r["prompt"] == 0 and r["round"] == 0), None)
        if reference and mine:
            same = sum(a == b for a, b in zip(reference["token_ids"], mine["token_ids"]))
            row["greedy_agreement_with_first"] = same / max(len(reference["token_ids"]), 1)


def _export(model: str, out: Path, gguf_dtype: str) -> Path:
    from tokenmill.bench.gguf_export import export_gguf

    return export_gguf(Path(model), out, gguf_dtype)


def _report(rows: list[dict[str, Any]], config: dict[str, Any], command: str) -> str:
    lines = [
        f"# compare: {Path(config['model']).name}, {config['num_prompts']} prompts x {config['prompt_tokens']} "
        f"tokens, {config['max_tokens']} generated, {config['dtype']}, threads={config['threads']}\n",
        "| backend | status | load s | generate s | tokens | tok/s | TTFT ms | pp tok/s | tg tok/s | tg GB/s "
        f"| share of the probe | peak MiB | greedy agreement with {config['backends'][0]} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, int | float) else "-"

    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['status']} | {f(r.get('load_time_s'), '.1f')} | "
            f"{f(r.get('generate_time_s'), '.1f')} | {f(r.get('completion_tokens'), 'd')} | "
            f"{f(r.get('tokens_per_second'), '.1f')} | {f(r.get('ttft_ms'), '.0f')} | "
            f"{f(r.get('pp_tokens_per_sec'), '.1f')} | {f(r.get('tg_tokens_per_sec'), '.2f')} | "
            f"{f(r.get('tg_gb_per_sec'), '.1f')} | {f(r.get('probe_share'), '.0%')} | "
            f"{f(r.get('peak_memory_mib'), '.0f')} | "
            f"{f(r.get('greedy_agreement_with_first'), '.2f')} |"
        )
    if config.get("rounds", 1) > 1:
        lines += _round_lines(rows, config)
    errors = [f"- {r['backend']}: {r.get('error')}" for r in rows if r["status"] != "ok"]
    probes = config.get("probes_gb_per_sec") or []
    rounds = " (the median of the rounds)" if config.get("rounds", 1) > 1 else ""
    footer = [
        f"Memory read bandwidth (probe, before the first run and after each): median {statistics.median(probes):.1f}"
        f" GB/s, {min(probes):.1f}-{max(probes):.1f} ({', '.join(f'{p:.1f}' for p in probes)}). tg GB/s = weight"
        f" bytes x tg tok/s; its share of the probe: each run's against the mean of the two probes around it{rounds}."
    ] if probes else []  # fmt: skip
    return "\n".join(lines + ([""] + errors if errors else []) + [""] + footer + [f"Command: `{command}`", ""])


def _round_lines(rows: list[dict[str, Any]], config: dict[str, Any]) -> list[str]:
    """Each round's tg of every backend, with the first backend's tg in the same round over it, and its share of the
    probes around its run."""
    first = rows[0].get("tg_by_round") or []
    lines = [
        "",
        f"tg tok/s by round ({config['rounds']} rounds; pp and tg above are the medians of the rounds; in brackets: "
        f"{config['backends'][0]}'s tg in the same round over this one's, and the run's share of the probe):",
    ]
    for r in rows:
        tgs, cells = r.get("tg_by_round") or [], []
        shares = r.get("probe_share_by_round") or [None] * len(tgs)
        for t, f0, share in zip(tgs, first + [None] * len(tgs), shares, strict=False):
            notes = ([f"{f0 / t:.2f}x"] if f0 and t and r is not rows[0] else []) + ([f"{share:.0%}"] if share else [])
            cells.append(("-" if t is None else f"{t:.2f}") + (f" ({', '.join(notes)})" if notes else ""))
        lines.append(f"- {r['backend']}: " + (", ".join(cells) if cells else "-"))
    return lines


def _plot(run: Run, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    keys = ("pp_tokens_per_sec", "tg_tokens_per_sec", "ttft_ms", "peak_memory_mib")
    titles = ("prompt processing tok/s", "generation tok/s", "TTFT ms", "peak memory MiB")
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    for ax, key, title in zip(axes, keys, titles):
        ax.bar([r["backend"].replace(" ", "\n") for r in ok], [r.get(key) or 0.0 for r in ok])
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(run.plot_path("compare.png"), dpi=100)
    plt.close(fig)


def add_compare_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="the same weights through tokenmill, transformers and llama.cpp")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument(
        "--backends", default="tokenmill,transformers,llama.cpp", help="comma list of NAME[:VARIANT] (llama.cpp:q8_0)"
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--num-prompts", type=positive_int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--gguf", default=None, help="use this GGUF for llama.cpp instead of converting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per backend")
    p.add_argument(
        "--rounds", type=int, default=1, help="run every backend this many times, in turn; pp and tg: the medians"
    )
    p.add_argument("--output-dir", default="bench-results")

"""Issue 56's serving targets on the machine at hand, tokenmill against llama-server on the same GGUF files.

Per file, one server at a time, each fresh (a warm start of tokenmill first, so its packed cache is made): `tokenmill
serve F` and `llama-server -m F -t 2 -tb 2 -np 16 -c 8192`, each driven by `tokenmill bench serve --workload custom
--request-rate inf --warmup 1`: one stream (4 requests of 64 in / 64 out) and 16 (32 of 128 / 128); the RSS of the
server's process tree right after the 16 streams (MB = 10^6 bytes); the model GFLOPS of the 16 streams and their share
of the FMA peak (`--flops-model F --probe-threads 2`: the AVX2 target's measure). Prints one markdown row per file, as
docs/benchmarks.md's tables have them. Say what else was running; never run it beside a build or tests.

    .venv/bin/python scripts/gguf_sitting.py F.gguf [F2.gguf ...] --llama-server /tmp/llbuild/bin/llama-server \
        --tokenizer ../shared/tokenizers/qwen2 [--pp512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from tokenmill.bench.flops import fma_share

TM = [sys.executable, "-m", "tokenmill"]
PORT = 8791


def wait_healthy(proc: subprocess.Popen[bytes], timeout: float = 600.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before it was healthy")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
            return time.monotonic() - t0
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"no healthy server within {timeout:.0f} s")


def bench(model: str, tokenizer: str, out: Path, streams: int, shape: tuple[int, int, int] | None = None) -> dict:
    """One `bench serve` run against the server on PORT: its summary. `shape`: (requests, input, output tokens);
    by default one stream's 4 of 64 / 64, or 16 streams' 32 of 128 / 128 with the model's GFLOPS."""
    n, length_in, length_out = shape or ((4, 64, 64) if streams == 1 else (32, 128, 128))
    flops = [] if streams == 1 else ["--flops-model", model, "--probe-threads", "2"]
    cmd = TM + ["bench", "serve", "--url", f"http://127.0.0.1:{PORT}", "--model", model, "--tokenizer", tokenizer,
                "--workload", "custom", "--request-rate", "inf", "--warmup", "1", "--max-concurrency", str(streams),
                "--num-prompts", str(n), "--input-len", str(length_in), "--output-len", str(length_out),
                "--output-dir", str(out), *flops]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    newest = max(out.glob("custom_*"), key=lambda p: p.stat().st_mtime)
    return json.loads((newest / "summary" / "summary.json").read_text())


def prefill_tok_s(cmd: list[str], model: str, tokenizer: str, out: Path) -> float:
    """pp512 through the server: 512 / TTFT p50 of 4 requests of 512 in / 1 out, one at a time, a fresh server."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc)
        summary = bench(model, tokenizer, out, 1, (4, 512, 1))
    finally:
        proc.terminate()
        proc.wait(60)
    return 512 / (summary["ttft_ms"]["p50"] / 1000)


def tree_rss_mb(pid: int) -> float:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 1e6


def one_server(cmd: list[str], model: str, tokenizer: str, out: Path) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        start = wait_healthy(proc)
        one, sixteen = bench(model, tokenizer, out, 1), bench(model, tokenizer, out, 16)
        return {"start": start, "one": one["output_throughput"], "tpot": one["tpot_ms"]["p50"],
                "sixteen": sixteen["output_throughput"], "ttft16": sixteen["ttft_ms"]["p50"],
                "flops16": fma_share(sixteen["flops"]),
                "rss": tree_rss_mb(proc.pid)}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--tokenizer", required=True, help="the files' tokenizer folder, for the load generator")
    p.add_argument("--output-dir", default="bench-results/gguf-sitting")
    p.add_argument(
        "--pp512",
        action="store_true",
        help="only pp512 per file: 512 / TTFT p50 of 4 prompts of 512 "
        "tokens, against llama-server -np 1 (with -np 16 a slot holds 512 tokens, too few for 513)",
    )
    a = p.parse_args()
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.pp512:
        print("| file | pp512 tok/s |\n|---|---|")
        for f in a.files:
            ours = prefill_tok_s(TM + ["serve", f, "--port", str(PORT)], f, a.tokenizer, out)
            one_slot = [a.llama_server, "-m", f, "-t", "2", "-tb", "2", "-np", "1", "-c", "8192", "--port", str(PORT)]
            theirs = prefill_tok_s(one_slot, f, a.tokenizer, out)
            print(f"| {Path(f).name} | {ours:.0f} vs {theirs:.0f} ({ours / theirs:.2f}×) |", flush=True)
        return
    print(
        "| file | one stream, output tok/s (decode: 1000 / TPOT p50) | 16 streams, output tok/s "
        "| TTFT p50 at 16, ms | model GFLOPS at 16 (share of the FMA peak) | start to healthy, s "
        "| RSS after 16 streams, MB |\n|---|---|---|---|---|---|---|"
    )
    for f in a.files:
        tm = TM + ["serve", f, "--port", str(PORT)]
        warm = subprocess.Popen(tm, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(warm)  # the first start packs the file into the cache: not the one measured
        warm.terminate()
        warm.wait(60)
        t = one_server(tm, f, a.tokenizer, out)
        llama = [a.llama_server, "-m", f, "-t", "2", "-tb", "2", "-np", "16", "-c", "8192", "--port", str(PORT)]
        ll = one_server(llama, f, a.tokenizer, out)
        print(f"| {Path(f).name} | {t['one']:.1f} vs {ll['one']:.1f} ({t['one'] / ll['one']:.2f}×; "
              f"{1000 / t['tpot']:.1f} vs {1000 / ll['tpot']:.1f}) "
              f"| {t['sixteen']:.1f} vs {ll['sixteen']:.1f} ({t['sixteen'] / ll['sixteen']:.2f}×) "
              f"| {t['ttft16']:.0f} vs {ll['ttft16']:.0f} | {t['flops16']} vs {ll['flops16']} "
              f"| {t['start']:.2f} vs {ll['start']:.2f} "
              f"| {t['rss']:.0f} vs {ll['rss']:.0f} ({t['rss'] / ll['rss']:.2f}×) |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""A smoke run per `tokenmill bench` subcommand on a tiny model: the folder layout, counts that add up,
and every figure finite and positive. No timing thresholds."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", initializer_range=0.1)


def bench(*args: str) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill", "bench", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Path(proc.stderr.strip().splitlines()[-1].removeprefix("results: "))


def assert_run_folder(run: Path) -> dict[str, Any]:
    for rel in (
        "manifest.json",
        "raw/trials.json",
        "raw/trials.csv",
        "summary/summary.json",
        "summary/summary.csv",
        "report.md",
    ):
        assert (run / rel).is_file(), rel
    assert list((run / "plots").glob("*.png"))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["command"] and manifest["machine"]["cpu_cores"] >= 1 and manifest["headline"]["value"] > 0
    index = list(csv.DictReader((run.parent / "index.csv").open()))
    assert any(row["id"] == run.name for row in index)
    return manifest


def assert_positive(values: dict[str, Any], *keys: str) -> None:
    for k in keys:
        v = values[k]
        assert isinstance(v, int | float) and math.isfinite(v) and v > 0, (k, v)


def test_latency(model: Path, tmp_path: Path) -> None:
    run = bench(
        "latency",
        str(model),
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--repeat",
        "2",
        "--output-dir",
        str(tmp_path),
    )
    manifest = assert_run_folder(run)
    assert manifest["warmup_excluded"] == 1
    rows = json.loads((run / "raw/trials.json").read_text())
    assert len(rows) == 3 and sum(r["warmup"] for r in rows) == 1
    s = json.loads((run / "summary/summary.json").read_text())
    assert_positive(s["pp16_tokens_per_sec"], "mean")
    assert_positive(s["tg4_tokens_per_sec"], "mean")
    assert_positive(s, "achieved_gb_per_sec", "peak_rss_mb", "weight_bytes", "read_bandwidth_gb_per_sec")
    # the memory probed before the warmup trial and after the last: the trials are judged against their mean
    assert len(s["probes_gb_per_sec"]) == 2 and min(s["probes_gb_per_sec"]) > 0
    assert s["read_bandwidth_gb_per_sec"] == pytest.approx(sum(s["probes_gb_per_sec"]) / 2)
    assert s["token_ms"]["n"] == 2 * 3  # every decode token of the measured trials: 4 tokens, 3 after the first
    assert 0 < s["token_ms"]["p50"] <= s["token_ms"]["p90"]
    assert {len(r["token_ms"]) for r in rows} == {3}


def test_latency_draws_with_the_sampling_asked_for(model: Path, tmp_path: Path) -> None:
    """--temperature, --top-k and --top-p reach the trials (the config records them), and a drawn run decodes every
    token it was asked for."""
    args = ["--prompt-tokens", "8", "--gen-tokens", "6", "--repeat", "1", "--warmup", "0"]
    run = bench("latency", str(model), *args, "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                "--output-dir", str(tmp_path))  # fmt: skip
    manifest = assert_run_folder(run)
    assert manifest["config"]["sampling"] == {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    rows = json.loads((run / "raw/trials.json").read_text())
    assert [r["gen_tokens"] for r in rows] == [6] and rows[0]["tg_tokens_per_sec"] > 0
    drawn = rows[0]["sampling"]  # the trial's SamplingParams fields
    assert {k: drawn[k] for k in ("temperature", "top_k", "top_p")} == {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    assert isinstance(drawn["seed"], int)


def test_throughput(model: Path, tmp_path: Path) -> None:
    run = bench(
        "throughput",
        str(model),
        "--num-prompts",
        "5",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--output-dir",
        str(tmp_path),
    )
    assert_run_folder(run)
    rows = json.loads((run / "raw/trials.json").read_text())
    assert len(rows) == 5 and all(r["output_tokens"] == 4 for r in rows)
    s = json.loads((run / "summary/summary.json").read_text())
    assert_positive(s, "output_tokens_per_sec", "total_tokens_per_sec", "requests_per_sec", "duration_s")
    assert s["decode_tokens_per_sec"] > 0  # one prefill step of all 5, then decode steps of all 5
    # the model GFLOPS: 5 requests of 8 prompt + 4 generated tokens (flops.model_flops) over the run's duration
    from tokenmill.bench.flops import matmul_params, model_flops

    body, head = matmul_params(str(model))
    assert s["flops"]["model_gflops"] == pytest.approx(model_flops(body, head, 40, 20, 5) / s["duration_s"] / 1e9)
    assert "| model GFLOPS (linears; formula below) |" in (run / "report.md").read_text()


@pytest.mark.parametrize("experiment", ["kv_cache", "prompt_length", "switches", "spec_decode"])
def test_sweep(model: Path, tmp_path: Path, experiment: str) -> None:
    run = bench(
        "sweep",
        str(model),
        "--experiment",
        experiment,
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
        "--gen-lengths",
        "4,8",
        "--prompt-lengths",
        "8,16",
        "--trials",
        "2",
        "--num-prompts",
        "3",
        "--grounded-text",
        str(Path(__file__).parent.parent / "data" / "demo_val.txt"),
        "--spec-k",
        "0,3",
        "--output-dir",
        str(tmp_path),
    )
    assert_run_folder(run)
    rows = json.loads((run / "summary/summary.json").read_text())
    expected = {"kv_cache": 4, "prompt_length": 2, "switches": 5, "spec_decode": 2}[experiment]
    assert len(rows) == expected
    if experiment == "spec_decode":  # k = 0 drafts nothing: its acceptance rate is 0
        assert [r["k"] for r in rows] == [0, 3] and rows[0]["acceptance_rate"] == 0
        assert all(r["tg_tokens_per_sec"] > 0 and r["tokens_per_decode_step"] >= 1 for r in rows)
        return
    for row in rows:
        assert_positive(row, *[k for k, v in row.items() if isinstance(v, float)])


def test_compare_and_report(model: Path, tmp_path: Path) -> None:
    run = bench(
        "compare",
        str(model),
        "--backends",
        "tokenmill,transformers,llama.cpp",
        "--num-prompts",
        "2",
        "--prompt-tokens",
        "8",
        "--max-tokens",
        "6",
        "--dtype",
        "float32",
        "--output-dir",
        str(tmp_path),
    )
    assert_run_folder(run)
    rows = {r["backend"]: r for r in json.loads((run / "summary/summary.json").read_text())}
    assert set(rows) == {"tokenmill", "transformers", "llama.cpp f32"}  # plain llama.cpp follows --dtype
    for backend in ("tokenmill", "transformers"):
        r = rows[backend]
        assert r["status"] == "ok" and r["completion_tokens"] == 12
        assert_positive(r, "load_time_s", "generate_time_s", "tokens_per_second", "ttft_ms", "peak_memory_mib")
        assert_positive(r, "pp_tokens_per_sec", "tg_tokens_per_sec")
    assert_positive(rows["tokenmill"], "tg_gb_per_sec", "probe_share")  # transformers reports no weight bytes
    probes = json.loads((run / "manifest.json").read_text())["config"]["probes_gb_per_sec"]
    assert rows["tokenmill"]["probe_share"] == pytest.approx(
        rows["tokenmill"]["tg_gb_per_sec"] / statistics.mean(probes[:2])
    )
    assert rows["transformers"]["greedy_agreement_with_first"] == 1.0  # same weights, same greedy tokens
    assert rows["llama.cpp f32"]["status"] in ("ok", "not installed", "unavailable", "error")  # never a crash
    report = bench("report", str(run), str(run), "--out", str(tmp_path / "rep"))
    assert report.name == "report.md" and (tmp_path / "rep" / "headlines.png").is_file()


def test_compare_in_rounds_takes_the_median_of_each_backends_rounds(model: Path, tmp_path: Path) -> None:
    """--rounds 3 runs every backend three times in turn; pp and tg are the medians of the rounds, and the report
    lists each round's tg with its ratio to the first backend's in that round. The memory is probed before the first
    run and after each: every run's share of the probe is its tg GB/s over the mean of the two probes around it."""
    args = ["--num-prompts", "1", "--prompt-tokens", "8", "--max-tokens", "6", "--rounds", "3"]
    run = bench("compare", str(model), "--backends", "tokenmill,tokenmill:int8", *args, "--output-dir", str(tmp_path))
    rows = {r["backend"]: r for r in json.loads((run / "summary/summary.json").read_text())}
    raw = json.loads((run / "raw/trials.json").read_text())
    config = json.loads((run / "manifest.json").read_text())["config"]
    probes = config["probes_gb_per_sec"]
    assert len(probes) == 1 + 2 * 3 and min(probes) > 0  # one before the first run, one after each of six
    assert config["read_bandwidth_gb_per_sec"] == sorted(probes)[3]
    n = len(rows)
    for i, (backend, row) in enumerate(rows.items()):
        assert row["status"] == "ok" and len(row["tg_by_round"]) == 3 and min(row["tg_by_round"]) > 0
        assert row["tg_tokens_per_sec"] == sorted(row["tg_by_round"])[1]
        assert sorted(r["round"] for r in raw if r["backend"] == backend) == [0, 1, 2]
        gb = row["tg_gb_per_sec"] / row["tg_tokens_per_sec"]  # weight bytes / 1e9
        # backends run in turn: round r's run of backend i sits between probes n r + i and n r + i + 1
        expected = [
            gb * tg / ((probes[n * r + i] + probes[n * r + i + 1]) / 2) for r, tg in enumerate(row["tg_by_round"])
        ]
        assert row["probe_share_by_round"] == pytest.approx(expected)
        assert row["probe_share"] == pytest.approx(sorted(expected)[1])
    report = (run / "report.md").read_text()
    assert "tg tok/s by round (3 rounds" in report and report.count("x, ") == 3  # int8's ratio in each round
    assert f"median {sorted(probes)[3]:.1f} GB/s" in report


def test_compare_report_names_a_round_without_tg() -> None:
    """A round whose runs gave no tg (one token each) is a dash in the rounds' lines, not a crash after every run."""
    from tokenmill.bench.compare import _report

    rows = [
        {"backend": "tokenmill", "status": "ok", "tg_by_round": [10.0, None], "probe_share_by_round": [0.5, None]},
        {"backend": "tokenmill int8", "status": "ok", "tg_by_round": [None, 20.0], "probe_share_by_round": [None, 0.4]},
    ]
    config = {
        **{"model": "m", "num_prompts": 1, "prompt_tokens": 8, "max_tokens": 1, "dtype": "bfloat16", "threads": 2},
        **{"backends": ["tokenmill", "tokenmill int8"], "rounds": 2, "probes_gb_per_sec": [30.0, 31.0, 50.0]},
    }
    report = _report(rows, config, "cmd")
    assert "- tokenmill: 10.00 (50%), -\n" in report and "- tokenmill int8: -, 20.00 (40%)\n" in report
    assert "median 31.0 GB/s, 30.0-50.0 (30.0, 31.0, 50.0)" in report and "(the median of the rounds)" in report


def test_compare_runs_peers_without_tokenmills_openmp_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """tokenmill sets OMP_WAIT_POLICY=PASSIVE for itself; a peer (llama.cpp's OpenMP threads, transformers) runs as
    its users run it: with their own setting, or none, even though its worker imports tokenmill."""
    import tokenmill
    from tokenmill.bench.compare import worker_env

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(tokenmill, "USER_OMP_WAIT_POLICY", None)
    assert worker_env("tokenmill")["OMP_WAIT_POLICY"] == "PASSIVE"
    peer = worker_env("llama.cpp")
    assert "OMP_WAIT_POLICY" not in peer
    probe = "import os, tokenmill; print(os.environ.get('OMP_WAIT_POLICY'))"
    seen = subprocess.run([sys.executable, "-c", probe], env=peer, capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == "None"  # the worker's own import of tokenmill left it unset
    monkeypatch.setattr(tokenmill, "USER_OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env("transformers")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_compare_backend_specs() -> None:
    from tokenmill.bench.compare import parse_backends

    assert parse_backends("tokenmill, llama.cpp,llama.cpp:q8_0", "bfloat16") == [
        ("tokenmill", None),
        ("llama.cpp", "bf16"),
        ("llama.cpp", "q8_0"),
    ]
    assert parse_backends("tokenmill:int8,transformers", "bfloat16") == [("tokenmill", "int8"), ("transformers", None)]
    assert parse_backends("tokenmill:q4_k,llama.cpp:q4_k", "bfloat16") == [("tokenmill", "q4_k"), ("llama.cpp", "q4_k")]
    for bad, words in (
        ("vllm", "unknown"),
        ("llama.cpp:q3_k", "q8_0"),
        ("tokenmill:fp4", "int4"),
        ("transformers:x", "no"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_backends(bad, "bfloat16")


def test_compare_runs_every_backend_on_one_gguf(model: Path, tmp_path: Path) -> None:
    from tokenmill.bench.compare import parse_backends
    from tokenmill.bench.gguf_export import export_gguf

    path = export_gguf(model, tmp_path / "tiny-q8_0.gguf", "q8_0")
    run = bench("compare", str(path), "--backends", "tokenmill,transformers,llama.cpp", "--num-prompts", "1",
                "--prompt-tokens", "8", "--max-tokens", "6", "--output-dir", str(tmp_path))  # fmt: skip
    rows = {r["backend"]: r for r in json.loads((run / "summary/summary.json").read_text())}
    assert set(rows) == {"tokenmill", "transformers", "llama.cpp"}  # llama.cpp runs the file itself: no variant
    assert rows["tokenmill"]["status"] == rows["transformers"]["status"] == "ok"
    assert rows["tokenmill"]["completion_tokens"] == rows["transformers"]["completion_tokens"] == 6
    assert not list(run.glob("model-*.gguf"))  # nothing converted
    with pytest.raises(ValueError, match="drop :q4_0"):
        parse_backends("llama.cpp:q4_0", "auto", gguf_model=True)


def test_profile_decode_puts_the_stack_stages_in_its_table_and_trace(model: Path, tmp_path: Path) -> None:
    """scripts/profile_decode.py on a model whose decode steps run through the decode stack: the stage table, and a
    Chrome trace whose `decode_stack` slices each hold every stage of every layer of each step of its decode run,
    inside the slice."""
    from tokenmill import kernels
    from tokenmill.config import EngineConfig

    if kernels.active() is None:
        pytest.skip("no compiled CPU kernels here: the decode steps run on the modules, with no stack to profile")
    trace = tmp_path / "trace.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "profile_decode.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(model), "--steps", "3", "--prompt-tokens", "8", "--dtype", "float32",
         "--trace", str(trace)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lm_head" in proc.stdout and "weight multiplications" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    slices = sorted((e for e in events if e.get("name") == "decode_stack"), key=lambda e: e["ts"])
    stages = [e for e in events if e.get("cat") == "decode_stack"]
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    runs = EngineConfig.num_scheduler_steps  # each engine step a decode run of this many steps, in one slice
    assert len(slices) == 3 and len(stages) == 3 * runs * (10 * layers + 2)
    for s in slices:
        inside = [e for e in stages if s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1]
        assert len(inside) == runs * (10 * layers + 2)


def test_profile_decode_prefill_groups_one_prefill_step_by_module(model: Path) -> None:
    """scripts/profile_decode.py --prefill: one prefill step of a batch of prompts, its time by module kind."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "profile_decode.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(model), "--prefill", "--batch", "2", "--prompt-tokens", "8", "--dtype",
         "float32"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout.split("group", 1)[1]
    assert "gate_up_proj" in table and "qkv_proj" in table and "weight multiplications" in table
    assert "prefill of 2 x 8 tokens" in proc.stdout

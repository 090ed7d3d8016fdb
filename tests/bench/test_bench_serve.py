"""Smoke tests for `tokenmill bench serve` against a real tokenmill server on 127.0.0.1 (tiny model, tiny sizes).

No timing thresholds: only the folder layout, the counts, and that every figure is finite and positive.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.helpers import Server, running
from tokenmill.bench.serve import make_plan, parse_goodput, sampling
from tokenmill.bench.serve_args import add_serve_parser
from tokenmill.bench.serve_run import run_serve

INPUT_LEN, OUTPUT_LEN = 16, 8


@pytest.fixture(scope="module")
def server(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    checkpoint = make_checkpoint("qwen2", initializer_range=0.1)
    with running(checkpoint, tmp_path_factory.mktemp("bench-server"), "--max-model-len", "512") as s:
        yield s


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def bench(server: Server, out: Path, *argv: str) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    sizes = ("--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--timeout", "60", "--max-duration", "120")
    args = parse("--url", server.url, "--model", server.model, "--output-dir", str(out), *sizes, *argv)
    run = run_serve(args)
    summary = json.loads((run / "summary" / "summary.json").read_text())
    rows = json.loads((run / "raw" / "trials.json").read_text())
    return run, summary, rows


def check_layout(run: Path, workload: str) -> dict[str, Any]:
    for rel in ("manifest.json", "raw/trials.json", "raw/trials.csv", "summary/summary.json", "summary/summary.csv",
                "plots/ttft_cdf.png", "plots/itl_cdf.png", "report.md"):  # fmt: skip
        assert (run / rel).is_file(), rel
    assert run.name.startswith(f"{workload}_")
    index = list(csv.DictReader((run.parent / "index.csv").open()))
    assert [r["id"] for r in index] == [run.name]
    assert index[0]["workload"] == workload and index[0]["backend"] == "tokenmill"
    assert index[0]["unit"] == "tok/s" and float(index[0]["value"]) > 0
    assert "| TTFT |" in (run / "report.md").read_text()
    return dict(json.loads((run / "manifest.json").read_text()))


def check_figures(summary: dict[str, Any], n: int) -> None:
    assert summary["requests_sent"] == n == summary["requests_completed"] + summary["requests_errors"]
    assert summary["requests_errors"] == 0 and summary["requests_not_sent"] == 0
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert stats["n"] > 0, key
        for name in ("mean", "p50", "p90", "p99"):
            assert math.isfinite(stats[name]) and stats[name] > 0, (key, name)
        assert math.isfinite(stats["std"]) and stats["std"] >= 0
    assert summary["total_output_tokens"] == n * OUTPUT_LEN


def test_custom_workload_with_local_tokenizer(server: Server, tokenizer_dir: Path, tmp_path: Path) -> None:
    run, summary, rows = bench(server, tmp_path, "--num-prompts", "6", "--request-rate", "20", "--warmup", "1",
                               "--tokenizer", str(tokenizer_dir), "--goodput", "ttft:60000,tpot:60000")  # fmt: skip
    manifest = check_layout(run, "custom")
    config = manifest["config"]
    assert config["num_prompts"] == 6 and config["request_rate"] == 20 and config["warmup"] == 1
    assert config["warmup_excluded"] is True and config["prompt_token_source"] == "tokenizer"
    assert config["goodput_slo_ms"] == {"ttft": 60000, "tpot": 60000} and config["model"] == server.model
    check_figures(summary, 6)
    assert summary["goodput"] > 0 and summary["goodput_fraction"] == 1.0
    assert len(rows) == 6
    for row in rows:
        assert row["ok"] and row["error"] is None
        assert row["output_tokens"] == OUTPUT_LEN and row["output_tokens_source"] == "usage"
        assert row["prompt_tokens"] == INPUT_LEN  # prompts fitted to exactly input-len tokens
        assert len(row["itl_ms"]) == row["chunks"] - 1
    with (run / "raw" / "trials.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 6


def test_prefix_caching_scaled_down_uses_server_tokenizer(server: Server, tmp_path: Path) -> None:
    run, summary, rows = bench(server, tmp_path, "--workload", "prefix_caching", "--num-prompts", "5",
                               "--request-rate", "inf", "--max-concurrency", "2", "--prefix-len", "48")  # fmt: skip
    config = check_layout(run, "prefix_caching")["config"]
    assert config["prefix_len"] == 48 and config["prompt_token_source"] == "server"
    assert config["max_concurrency"] == 2 and config["warmup"] == 0 and config["warmup_excluded"] is False
    check_figures(summary, 5)
    assert all(r["kind"] == "prefixed" and r["output_tokens"] == OUTPUT_LEN for r in rows)
    assert all(abs(r["prompt_tokens"] - (48 + INPUT_LEN)) <= 2 for r in rows)


def test_drawn_requests_send_and_record_their_sampling(server: Server, tmp_path: Path) -> None:
    """--temperature makes every request draw, with the top_p, top_k and min_p given; the manifest keeps them.
    Greedy sends the temperature alone."""
    assert sampling(parse("--url", "http://x", "--model", "m")) == {"temperature": 0.0}
    assert sampling(parse("--url", "x", "--model", "m", "--temperature", "1")) == {"temperature": 1.0, "top_p": 1.0}
    drawn = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    run, summary, rows = bench(server, tmp_path, "--num-prompts", "3", "--max-concurrency", "3", "--temperature", "0.8",
                               "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05")  # fmt: skip
    assert check_layout(run, "custom")["config"]["sampling"] == drawn
    check_figures(summary, 3)
    assert all(r["ok"] and r["output_tokens"] == OUTPUT_LEN for r in rows)


def test_errors_are_recorded_not_raised(server: Server, tmp_path: Path) -> None:
    args = parse("--url", server.url, "--model", "no-such-model", "--output-dir", str(tmp_path), "--num-prompts", "3",
                 "--input-len", "4", "--output-len", "2", "--timeout", "30")  # fmt: skip
    summary = json.loads((run_serve(args) / "summary" / "summary.json").read_text())
    assert summary["requests_sent"] == 3 == summary["requests_errors"] and summary["requests_completed"] == 0
    # The run bound: arrivals at 0 s, 1.69 s, 1.79 s (seed 0, 1 req/s) and a 0.5 s bound -> two are never sent.
    args = parse("--url", server.url, "--model", server.model, "--output-dir", str(tmp_path), "--num-prompts", "3",
                 "--request-rate", "1", "--input-len", "4", "--output-len", "2", "--max-duration", "0.5")  # fmt: skip
    summary = json.loads((run_serve(args) / "summary" / "summary.json").read_text())
    assert summary["requests_not_sent"] == 2 and summary["requests_sent"] == 1
    assert summary["requests_sent"] == summary["requests_completed"] + summary["requests_errors"]


def test_workload_defaults_overrides_and_scaling() -> None:
    base = parse("--url", "http://x", "--model", "m")
    plan = make_plan(base, "baseline", None)
    assert (plan.num_prompts, plan.max_concurrency, plan.request_rate) == (10, 1, math.inf)
    plan = make_plan(base, "prefix_caching", None)
    assert (plan.num_prompts, plan.request_rate, plan.prefix_len) == (48, 8.0, 1024)
    plan = make_plan(base, "prefix_caching", 512)  # scaled to the context: 512 - 128 out - 8 margin - 128 in
    assert plan.prefix_len == 512 - 128 - 8 - 128
    plan = make_plan(base, "chunked_prefill", 4096)
    assert (plan.num_prompts, plan.request_rate, plan.long_fraction, plan.long_len) == (48, 6.0, 0.75, 512)
    over = parse("--url", "http://x", "--model", "m", "--num-prompts", "3", "--request-rate", "2", "--input-len", "7")
    plan = make_plan(over, "burst", None)
    assert (plan.num_prompts, plan.request_rate, plan.input_len) == (3, 2.0, 7)
    assert parse_goodput("ttft:500,tpot:50,e2e:9000") == {"ttft": 500.0, "tpot": 50.0, "e2e": 9000.0}
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput("itl:5")


def test_server_peers_side_by_side(server: Server, tmp_path: Path) -> None:
    # The "peer" is the same tokenmill server under another label; its model name comes from /v1/models.
    table = run_serve(parse("--url", server.url, "--model", server.model, "--output-dir", str(tmp_path),
                            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--num-prompts", "2",
                            "--max-concurrency", "2", "--server-peers", f"again={server.url}"))  # fmt: skip
    assert table.name.startswith("serve-side-by-side-") and table.suffix == ".md"
    body = [line for line in table.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0] for line in body] == ["| tokenmill", "| again"]
    assert all(" | 2/2 | " in line for line in body)
    index = list(csv.DictReader((tmp_path / "index.csv").open()))
    assert [r["backend"] for r in index] == ["tokenmill", "again"]
    peer = json.loads((tmp_path / index[1]["id"] / "manifest.json").read_text())["config"]
    assert peer["model"] == server.model and peer["url"] == server.url


@pytest.mark.parametrize("spec", ["nolabel", "x=localhost:8000", "=http://h:1"])
def test_server_peers_bad_spec(spec: str) -> None:
    from tokenmill.bench.serve_peers import parse_peers

    with pytest.raises(ValueError, match="LABEL=http"):
        parse_peers(spec)


def test_flops_model_adds_the_runs_model_gflops_and_their_share_of_each_peak(
    server: Server, make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """--flops-model: the summary's model GFLOPS are bench/flops.py's formula over the run's own tokens and duration,
    each probed peak has its share, and the report and side-by-side table show them (no speed asserted)."""
    from tokenmill.bench.flops import matmul_params, model_flops

    checkpoint = make_checkpoint("qwen2", initializer_range=0.1)
    run, summary, _ = bench(server, tmp_path, "--num-prompts", "2", "--flops-model", str(checkpoint))
    f = summary["flops"]
    body, head = matmul_params(str(checkpoint))
    ops = model_flops(body, head, summary["total_input_tokens"], summary["total_output_tokens"], 2)
    assert f["model_gflops"] == pytest.approx(ops / summary["duration_s"] / 1e9)
    for p in f["peaks"]:
        assert math.isfinite(p["giga_ops"]) and p["giga_ops"] > 0
        assert p["share"] == pytest.approx(f["model_gflops"] / p["giga_ops"])
    assert "| model GFLOPS (linears; formula below) |" in (run / "report.md").read_text()


def test_agent_workload_grows_conversations_and_reads_the_prefix_cache(server: Server, tmp_path: Path) -> None:
    """`--workload agent`: each conversation's turns go one after another, each prompt the last one plus the answer
    and a new message, so every later turn's prompt is mostly served from the prefix cache; the summary says so by
    turn, from the server's `usage.prompt_tokens_details.cached_tokens`."""
    args = parse("--url", server.url, "--model", server.model, "--output-dir", str(tmp_path), "--workload", "agent",
                 "--conversations", "2", "--turns", "3", "--input-len", "60", "--max-context", "300",
                 "--output-len", "6", "--timeout", "60", "--max-duration", "120")  # fmt: skip
    run = run_serve(args)
    summary = json.loads((run / "summary" / "summary.json").read_text())
    rows = json.loads((run / "raw" / "trials.json").read_text())
    assert summary["requests_completed"] == 6 and summary["requests_errors"] == 0
    for c in (0, 1):
        turns = sorted((r for r in rows if r["conversation"] == c), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        for before, after in itertools.pairwise(turns):
            assert after["start_s"] >= before["end_s"]  # a turn waits for the last answer
            assert after["prompt_tokens"] > before["prompt_tokens"] + before["output_tokens"]
            # the history before it was computed last turn: all but its last partial KV block comes from the cache
            assert before["prompt_tokens"] - 16 <= after["cached_tokens"] < after["prompt_tokens"]
    agent = summary["agent"]
    assert agent["turns"] == 3 and len(agent["ttft_p50_by_turn_ms"]) == 3 and 0.3 < agent["prefix_hit_rate"] < 1
    assert "| turn | prompt tokens | TTFT p50 ms |" in (run / "report.md").read_text()


def test_request_models_take_turns_in_the_requests_bodies() -> None:
    """--request-models spreads the requests over LoRA adapters (or a server's models) in turn; without it every
    request names --model."""
    from tokenmill.bench.serve import _body

    args = argparse.Namespace(model="base", request_models="a1,a2,a3", endpoint="completions", temperature=0.0)
    assert [_body(args, "hi", 4, i)["model"] for i in range(5)] == ["a1", "a2", "a3", "a1", "a2"]
    args.request_models = None
    assert {_body(args, "hi", 4, i)["model"] for i in range(3)} == {"base"}

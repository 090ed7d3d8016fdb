"""Several models behind one real `tokenmill serve` (`--model NAME=PATH`, `--models-config`): a request's `model`
routes it, a model loads when first asked for (once, however many ask), the least recently used idle one is
unloaded past --max-loaded-models or --models-memory-gb, an idle one is unloaded after --idle-unload-seconds and its
memory leaves the process, a busy one is never unloaded (the request that would need it gets 503), and a model that
fails to load fails only its own requests. Two tiny random models of different shapes: `small` (~20 MB of float32
weights) and `big` (~72 MB)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import Server, assert_openai_error, offline, running
from tests.server.hold import Hold, hold_env
from tests.unit.test_cli import assert_one_line_error, run_cli
from tokenmill import LLM
from tokenmill.bench.serve_args import add_serve_parser
from tokenmill.bench.serve_run import run_serve

HOLD_TOKEN = 8  # a prompt starting with it is held mid-request (tests/server/hold.py)
FATAL_TOKEN = 9  # a step computing a prompt that starts with it kills its engine's loop (fault_hooks.py)
PROMPT = [20, 30, 40, 50]
SMALL = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
BIG = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=2)
ENGINE = ("--max-model-len", "256", "--max-num-seqs", "4")  # a small KV pool: the weights are what is counted
WAIT_S = 120.0  # a bound on waiting for a load or an unload to show (never a timing assertion)


@pytest.fixture(scope="module")
def small(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1, **SMALL)


@pytest.fixture(scope="module")
def big(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", initializer_range=0.1, seed=1, **BIG)


def _start(tmp: pytest.TempPathFactory, hold: Hold, *flags: str) -> Any:
    env = {**hold_env(HOLD_TOKEN, hold.folder), "TOKENMILL_TEST_FAULT_TOKEN": str(FATAL_TOKEN),
           "TOKENMILL_TEST_FAULT_FATAL": "1"}  # fmt: skip
    return running(None, tmp.mktemp("server"), *ENGINE, *flags, env=env)


@pytest.fixture(scope="module")
def by_count(small: Path, big: Path, tmp_path_factory: pytest.TempPathFactory, hold: Hold) -> Iterator[Server]:
    """Two models, one loaded at a time."""
    with _start(tmp_path_factory, hold, "--model", f"small={small}", "--model", f"big={big}",
                "--max-loaded-models", "1") as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def by_memory(small: Path, big: Path, tmp_path_factory: pytest.TempPathFactory, hold: Hold) -> Iterator[Server]:
    """Two models and a memory budget that holds either, not both."""
    from tokenmill.assembly.estimate import estimate_bytes
    from tokenmill.config import EngineConfig

    def estimate(path: Path) -> int:
        return estimate_bytes(EngineConfig(model=str(path), dtype="float32", max_model_len=256, max_num_seqs=4))

    budget_gb = (estimate(big) + estimate(small) / 2) / 2**30
    with _start(tmp_path_factory, hold, "--model", f"small={small}", "--model", f"big={big}",
                "--models-memory-gb", f"{budget_gb:.6f}") as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def from_file(small: Path, big: Path, tmp_path_factory: pytest.TempPathFactory, hold: Hold) -> Iterator[Server]:
    """A config file: `big` with its own max_model_len, and `broken`, whose load fails (a max_model_len past its
    model's); models idle for 2 s are unloaded."""
    folder = tmp_path_factory.mktemp("config")
    config = folder / "models.yaml"
    config.write_text(f"models:\n  - name: big\n    path: {big}\n    max-model-len: 128\n"
                      f"  - name: broken\n    path: {small}\n    max_model_len: 100000\n")  # fmt: skip
    with _start(tmp_path_factory, hold, "--models-config", str(config), "--idle-unload-seconds", "2") as s:
        yield s


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)


def _states(server: Server) -> dict[str, str]:
    return {m.id: m.status for m in _client(server).models.list().data}  # type: ignore[attr-defined]


def _metric(server: Server, name: str, model: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == name and s.labels.get("model_name") == model]  # fmt: skip
    return sum(found)


def _collector(server: Server) -> tuple[float, float]:
    """(tokenmill:python_gc_enabled, tokenmill:python_gc_frozen_objects)"""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["tokenmill:python_gc_enabled"], values["tokenmill:python_gc_frozen_objects"]


def _complete(server: Server, model: str, max_tokens: int = 4) -> str:
    r = _client(server).completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert r.model == model
    return r.choices[0].text


def _wait_for(server: Server, model: str, status: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while _states(server)[model] != status:
        assert time.monotonic() < deadline, f"{model} not {status} within {WAIT_S} s: {_states(server)}"
        time.sleep(0.1)


def test_requests_route_by_model_and_models_list_their_states(by_count: Server, small: Path, big: Path) -> None:
    assert _states(by_count) == {"small": "unloaded", "big": "unloaded"}  # (nothing loads before it is asked for)
    wants = {}
    for name, path in (("small", small), ("big", big)):
        wants[name] = offline(LLM(str(path), dtype="float32"), {"prompt_token_ids": PROMPT}, 4).text
        assert _complete(by_count, name) == wants[name]  # the model the request named answered
        assert _states(by_count)[name] == "loaded"
    assert wants["small"] != wants["big"]  # (so the answers above tell the models apart)
    # the collector, paused for the imports (tokenmill/memory.py), runs here, with nothing frozen: these models may
    # unload, and a frozen model's cycles would never be collected
    assert _collector(by_count) == (1, 0)
    card = _client(by_count).models.retrieve("big")
    assert card.max_model_len == 256  # type: ignore[attr-defined]


def test_unknown_or_missing_model_is_404_naming_the_models(by_count: Server) -> None:
    r = httpx.post(f"{by_count.url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert_openai_error(r, 404, "nope", "small", "big")
    r = httpx.post(f"{by_count.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(r, 404, "small", "big")
    with pytest.raises(openai.NotFoundError, match="small"):
        _client(by_count).models.retrieve("nope")
    assert httpx.get(f"{by_count.url}/health").status_code == 200


def test_lora_routes_refuse_several_models(by_count: Server) -> None:
    """LoRA adapters are served with one MODEL only: loading one here is a 400 that says so, nothing loads."""
    before = _states(by_count)
    r = httpx.post(f"{by_count.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert_openai_error(r, 400, "several models", "one MODEL")
    r = httpx.post(f"{by_count.url}/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert_openai_error(r, 400, "several models")
    assert _states(by_count) == before


def test_past_max_loaded_models_the_least_recently_used_goes(by_count: Server) -> None:
    _complete(by_count, "small")
    unloads = _metric(by_count, "tokenmill:model_unloads_total", "small")
    loads = _metric(by_count, "tokenmill:model_loads_total", "big")
    _complete(by_count, "big")
    assert _states(by_count) == {"small": "unloaded", "big": "loaded"}
    assert _metric(by_count, "tokenmill:model_unloads_total", "small") == unloads + 1
    assert _metric(by_count, "tokenmill:model_loads_total", "big") == loads + 1
    assert _metric(by_count, "tokenmill:model_loaded", "big") == 1
    assert _metric(by_count, "tokenmill:model_loaded", "small") == 0
    assert _metric(by_count, "tokenmill:model_load_seconds_count", "big") >= 1


def test_two_requests_for_a_cold_model_load_it_once(by_count: Server) -> None:
    """Both are sent at once while `small` is unloaded; loading takes far longer than sending, so the second
    arrives during the first's load and must wait on that same load."""
    _complete(by_count, "big")  # (one model at a time: small is unloaded now)
    assert _states(by_count)["small"] == "unloaded"
    loads = _metric(by_count, "tokenmill:model_loads_total", "small")
    texts: list[str] = []
    threads = [threading.Thread(target=lambda: texts.append(_complete(by_count, "small"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert len(texts) == 2 and texts[0] == texts[1]
    assert _metric(by_count, "tokenmill:model_loads_total", "small") == loads + 1


def _busy_model_is_not_unloaded(server: Server, hold: Hold, busy: str, other: str, limit: str) -> None:
    """A stream on `busy` is held mid-request; a request for `other`, which would need `busy` unloaded, gets 503
    naming `limit`; then the stream goes on to its last token, and `other` loads once `busy` is idle."""
    _complete(server, busy)
    chunks: list[Any] = []

    def stream() -> None:
        for chunk in _client(server).completions.create(model=busy, prompt=[HOLD_TOKEN, *PROMPT], max_tokens=8,
                                                        stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
            chunks.append(chunk)

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        hold.wait_held()
        r = httpx.post(f"{server.url}/v1/completions", json={"model": other, "prompt": PROMPT, "max_tokens": 2},
                       timeout=WAIT_S)  # fmt: skip
        assert_openai_error(r, 503, limit, other)
        assert int(r.headers["retry-after"]) > 0
        assert _states(server)[busy] == "loaded"
    finally:
        hold.release()
        reader.join(WAIT_S)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    _complete(server, other)
    assert _states(server)[other] == "loaded"


def test_a_held_stream_is_not_cut_by_max_loaded_models(by_count: Server, hold: Hold) -> None:
    _busy_model_is_not_unloaded(by_count, hold, "big", "small", "--max-loaded-models=1")


def test_memory_budget_unloads_lru_and_refuses_when_all_are_busy(by_memory: Server, hold: Hold) -> None:
    _complete(by_memory, "small")
    _complete(by_memory, "big")  # both do not fit: small, idle, goes
    assert _states(by_memory) == {"small": "unloaded", "big": "loaded"}
    _busy_model_is_not_unloaded(by_memory, hold, "big", "small", "--models-memory-gb")
    assert _states(by_memory) == {"small": "loaded", "big": "unloaded"}


def test_an_idle_model_is_unloaded_and_its_memory_returned(from_file: Server, hold: Hold) -> None:
    """While `big` is held mid-request the idle timer cannot unload it; once released and idle for 2 s it goes,
    and the server's resident memory drops by at least half its ~72 MB of weights."""
    proc = psutil.Process(from_file.proc.pid)
    unloads = _metric(from_file, "tokenmill:model_unloads_total", "big")
    reader = threading.Thread(target=lambda: _complete_held(from_file))
    reader.start()
    try:
        hold.wait_held()
        assert _states(from_file)["big"] == "loaded"
        card = _client(from_file).models.retrieve("big")
        assert card.max_model_len == 128  # type: ignore[attr-defined]  # (the file's own flag for it)
        loaded_rss = proc.memory_info().rss
    finally:
        hold.release()
        reader.join(WAIT_S)
    _wait_for(from_file, "big", "unloaded")
    # the state says unloaded once no request can reach the engine; the unload counts once its memory went back
    # (the engine's loop stopped, its tensors collected, the allocator trimmed), which a busy machine takes a while to
    deadline = time.monotonic() + WAIT_S
    while _metric(from_file, "tokenmill:model_unloads_total", "big") <= unloads:
        assert time.monotonic() < deadline, f"big's unload did not finish within {WAIT_S} s"
        time.sleep(0.1)
    dropped = loaded_rss - proc.memory_info().rss
    assert dropped > 36 * 2**20, f"RSS dropped by {dropped / 2**20:.1f} MiB"
    assert _complete(from_file, "big")  # and it loads again on demand


def _complete_held(server: Server) -> None:
    _client(server).completions.create(
        model="big", prompt=[HOLD_TOKEN, *PROMPT], max_tokens=16, extra_body={"ignore_eos": True}
    )


def test_a_model_that_fails_to_load_fails_only_its_requests(from_file: Server) -> None:
    r = httpx.post(f"{from_file.url}/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 1},
                   timeout=WAIT_S)  # fmt: skip
    error = assert_openai_error(r, 503, "broken", "max_model_len")
    assert error["code"] == "model_load_failed"
    broken = next(m for m in httpx.get(f"{from_file.url}/v1/models").json()["data"] if m["id"] == "broken")
    assert broken["status"] == "unloaded" and "max_model_len" in broken["error"]
    assert _complete(from_file, "big")
    assert httpx.get(f"{from_file.url}/health").status_code == 200


def test_a_dead_engine_fails_its_requests_and_is_replaced_at_the_next(from_file: Server) -> None:
    """With several models a dead engine loop does not end the server (one MODEL alone does): its request gets the
    error, the model shows unloaded, and the next request for it loads it anew."""
    _complete(from_file, "big")
    r = httpx.post(f"{from_file.url}/v1/completions", json={"model": "big", "prompt": [FATAL_TOKEN, *PROMPT],
                   "max_tokens": 2}, timeout=WAIT_S)  # fmt: skip
    assert_openai_error(r, 500, "engine loop has stopped")
    assert _states(from_file)["big"] == "unloaded"
    assert _complete(from_file, "big")
    assert _states(from_file)["big"] == "loaded" and from_file.proc.poll() is None


def _switch(server: Server, out: Path, *argv: str) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """`tokenmill bench serve --workload switch` against `server`: its summary, rows and report."""
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--url", server.url, "--model", "small", "--workload", "switch",
                              "--output-dir", str(out), "--input-len", "4", "--output-len", "2", *argv])  # fmt: skip
    run = run_serve(args)
    summary = json.loads((run / "summary" / "summary.json").read_text())
    return summary, json.loads((run / "raw" / "trials.json").read_text()), (run / "report.md").read_text()


def test_the_switch_benchmark_times_cold_loads_and_reads_memory_after_the_idle_unload(
    by_count: Server, from_file: Server, tmp_path: Path
) -> None:
    # one model loaded at a time: after the first, each request to the other model is a cold one, and loads it
    summary, rows, report = _switch(
        by_count, tmp_path / "count", "--request-models", "small,big,small", "--num-prompts", "3"
    )
    assert [r["model"] for r in rows] == ["small", "big", "small"] and all(r["ok"] for r in rows)
    assert [r["cold"] for r in rows[1:]] == [True, True]
    assert all(r["loaded_after"] == [r["model"]] for r in rows)
    assert all((r["load_s"] is not None) == r["cold"] for r in rows)
    assert summary["cold_requests"] == summary["load_s"]["n"] >= 2 and summary["cold_ttft_ms"]["p50"] > 0
    assert summary["rss_peak_mb"] >= summary["rss_start_mb"] > 0 and summary["rss_after_idle_unload_mb"] is None
    assert "| 2 | small | yes |" in report
    # idle models unloaded after 2 s: the baseline and the end have none loaded
    summary, rows, report = _switch(from_file, tmp_path / "idle", "--request-models", "big", "--num-prompts", "2",
                                    "--idle-wait", str(WAIT_S))  # fmt: skip
    assert [r["cold"] for r in rows] == [True, False] and all(r["ok"] for r in rows)
    assert set(summary["states_at_start"].values()) == {"unloaded"}
    assert summary["idle_unload_waited_s"] is not None and summary["rss_after_idle_unload_mb"] > 0
    assert summary["warm_ttft_ms"]["n"] == 1 and "after every model was unloaded" in report


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--model", "noequals"], "--model 'noequals' is invalid: allowed NAME=PATH"),
        (["--model", "a b=x"], "allowed NAME=PATH"),
        (["--model", "a={small}", "--model", "a={small}"], "'a' is given twice"),
        (["{small}", "--model", "a={small}"], "not both"),
        (["{small}", "--max-loaded-models", "2"], "--max-loaded-models applies to several models"),
        (["--model", "a={small}", "--max-loaded-models", "0"], "--max-loaded-models=0 is invalid"),
        (["--model", "a={small}", "--data-parallel-size", "2"], "allowed 1"),
        (["--models-config", "{tmp}/none.yaml"], "cannot be read"),
        (["--models-config", "{tmp}/bad.yaml"], "not valid YAML"),
        (["--models-config", "{tmp}/unknown.yaml"], "unknown key 'colour'"),
        (["--models-config", "{tmp}/typed.yaml"], "max_model_len='4' is invalid: allowed int or null"),
        (["--models-config", "{tmp}/shape.yaml"], "allowed one key, `models`"),
        (["--model", "a={tmp}/no-such-folder"], "does not exist"),
        (["--model", "a={small}", "--enable-lora"], "LoRA adapters (--lora-modules, --enable-lora) serve one MODEL"),
        (["--models-config", "{tmp}/lora.yaml"], "LoRA adapters (--lora-modules, --enable-lora) serve one MODEL"),
    ],
)
def test_bad_models_flags_are_one_line_errors(small: Path, tmp_path: Path, args: list[str], said: str) -> None:
    (tmp_path / "bad.yaml").write_text("models: [unclosed\n")
    (tmp_path / "unknown.yaml").write_text(json.dumps({"models": [{"name": "a", "path": str(small), "colour": 1}]}))
    (tmp_path / "typed.yaml").write_text(f"models:\n  - {{name: a, path: {small}, max_model_len: '4'}}\n")
    (tmp_path / "shape.yaml").write_text(f"- {{name: a, path: {small}}}\n")
    (tmp_path / "lora.yaml").write_text(f"models:\n  - {{name: a, path: {small}, enable_lora: true}}\n")
    argv = [a.format(small=small, tmp=tmp_path) for a in args]
    assert_one_line_error(run_cli("serve", *argv, "--port", "0"), said)

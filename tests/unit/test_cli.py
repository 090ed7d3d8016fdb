"""The `tokenmill` command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1)


def test_generate_json(folder: Path) -> None:
    proc = run_cli("generate", str(folder), "--prompt", "Hello", "--max-tokens", "7", "--temperature", "0",
                   "--ignore-eos", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {"text", "token_ids", "finish_reason", "timings"}
    assert len(result["token_ids"]) == 7 and result["finish_reason"] == "length"
    timings = result["timings"]
    assert set(timings) == {"prompt_tokens", "tokenization_ms", "ttft_ms", "decode_tokens_per_sec", "total_ms",
                            "peak_rss_mb"}  # fmt: skip
    assert timings["prompt_tokens"] >= 1
    for key in ("tokenization_ms", "ttft_ms", "decode_tokens_per_sec", "total_ms", "peak_rss_mb"):
        assert timings[key] > 0, key
    from tokenmill.tokenizer import Tokenizer

    assert result["text"] == Tokenizer(folder).decode(result["token_ids"])


def test_generate_streams_text_then_summary(folder: Path) -> None:
    proc = run_cli("generate", str(folder), "--prompt", "Hello", "--max-tokens", "5", "--temperature", "0",
                   "--ignore-eos")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    for key in ("prompt tokens:", "tokenization:", "TTFT:", "decode:", "tok/s", "peak RSS:"):
        assert key in summary
    as_json = json.loads(run_cli("generate", str(folder), "--prompt", "Hello", "--max-tokens", "5",
                                 "--temperature", "0", "--ignore-eos", "--json").stdout)  # fmt: skip
    assert proc.stdout.rstrip("\n") == as_json["text"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["generate", "m", "--prompt", "x", "--temperature", "abc"],
            ["--temperature", "invalid float value"],
        ),
        (["generate", "m", "--prompt", "x", "--dtype", "float8"], ["--dtype", "invalid choice"]),
        (["generate", "m"], ["--prompt"]),
        (["frobnicate"], ["invalid choice"]),
        (["make-model", "--arch", "gpt9", "--shape", "tiny", "--tokenizer", "t", "--out", "o"], ["--arch"]),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], fragments: list[str]) -> None:
    assert_one_line_error(run_cli(*args), *fragments)


def test_bad_values_and_models_are_one_line(folder: Path, tmp_path: Path) -> None:
    proc = run_cli("generate", str(folder), "--prompt", "x", "--temperature", "-1")
    assert_one_line_error(proc, "temperature=-1.0", "allowed values >= 0")
    assert_one_line_error(run_cli("generate", str(tmp_path / "a" / "b"), "--prompt", "x"), "does not exist")
    offline = run_cli("generate", "nobody/nothing", "--prompt", "x", env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(offline, "nobody/nothing", "local checkpoint folder")
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 8,
                                                 "num_attention_heads": 2, "num_hidden_layers": 1,
                                                 "intermediate_size": 8, "vocab_size": 8}))  # fmt: skip
    assert_one_line_error(run_cli("generate", str(bad), "--prompt", "x"), "GPTNeoXForCausalLM", "supported")


def test_make_model_tiny_loads_in_both(tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    proc = run_cli("make-model", "--arch", "qwen3", "--shape", "tiny", "--tokenizer", str(tokenizer_dir),
                   "--out", str(out), "--dtype", "float32", "--seed", "3")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file()
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM

    hf = AutoModelForCausalLM.from_pretrained(str(out))
    assert hf.config.num_hidden_layers == 2 and hf.config.model_type == "qwen3"
    assert LLM(str(out)).loaded.config.qk_norm
    bad = run_cli("make-model", "--arch", "llama", "--shape", "tiny", "--tokenizer", str(tmp_path / "none"),
                  "--out", str(tmp_path / "x"))  # fmt: skip
    assert_one_line_error(bad, "--tokenizer")


def test_make_model_to_a_path_it_cannot_write_is_one_line(tokenizer_dir: Path, tmp_path: Path) -> None:
    """An --out under a folder that cannot exist, or a folder where the GGUF file goes: one line naming the path
    (FileNotFoundError's and IsADirectoryError's tracebacks before)."""
    base = ["make-model", "--arch", "llama", "--shape", "tiny", "--tokenizer", str(tokenizer_dir)]
    assert_one_line_error(run_cli(*base, "--out", "/proc/nope/x"), "/proc/nope")
    assert_one_line_error(run_cli(*base, "--gguf", "bf16", "--out", str(tmp_path)), str(tmp_path))


def test_make_model_device_draws_there_or_says_why_not(tokenizer_dir: Path, tmp_path: Path) -> None:
    import torch

    args = ["make-model", "--arch", "llama", "--shape", "tiny", "--tokenizer", str(tokenizer_dir), "--dtype",
            "float32"]  # fmt: skip
    cpu = run_cli(*args, "--out", str(tmp_path / "cpu"), "--device", "cpu")
    assert cpu.returncode == 0, cpu.stderr
    gpu = run_cli(*args, "--out", str(tmp_path / "gpu"), "--device", "cuda")
    if torch.cuda.is_available():  # (the lent GPU's run: the weights drawn there, written as on the CPU)
        assert gpu.returncode == 0, gpu.stderr
        assert (tmp_path / "gpu" / "model.safetensors").stat().st_size == (
            tmp_path / "cpu" / "model.safetensors"
        ).stat().st_size
    else:
        assert_one_line_error(gpu, "--device 'cuda'", "0 CUDA GPU", "--device cpu")
        assert not (tmp_path / "gpu" / "model.safetensors").exists()
    assert_one_line_error(run_cli(*args, "--out", str(tmp_path / "x"), "--device", "tpu"), "--device", "tpu")
    gguf = run_cli(*args, "--out", str(tmp_path / "x.gguf"), "--gguf", "q8_0", "--device", "cuda")
    assert_one_line_error(gguf, "--device cuda", "--gguf")


def test_the_llama_3_1_8b_shape_has_the_real_models_parameter_count() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.make_model import SHAPES, hf_config

    with torch.device("meta"):  # (no memory: the shapes alone)
        model = AutoModelForCausalLM.from_config(hf_config("llama", **SHAPES["llama-3.1-8b"]))
    # Meta-Llama-3.1-8B's safetensors hold 8,030,261,248 parameters (issue 63's roofline model)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert model.config.rope_scaling["rope_type"] == "llama3" and not model.config.tie_word_embeddings


def test_generate_without_model_uses_the_demo() -> None:
    from tests.parity.test_demo_model import GOLDEN_TEXT

    proc = run_cli("generate", "--prompt", "ROMEO:", "--max-tokens", "40", "--temperature", "0", "--dtype",
                   "float32", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] == GOLDEN_TEXT


def test_serve_flag_errors_are_one_line(folder: Path, tmp_path: Path) -> None:
    assert_one_line_error(run_cli("serve", str(folder), "--port", "99999"), "--port=99999", "[0, 65535]")
    assert_one_line_error(run_cli("serve", str(folder), "--max-n", "0"), "--max-n=0")
    assert_one_line_error(run_cli("serve", str(folder), "--responses-store-size", "-1"), "--responses-store-size=-1")
    missing = str(tmp_path / "no-key")
    assert_one_line_error(run_cli("serve", str(folder), "--api-key-file", missing), "--api-key-file", "cannot be read")


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--prefix-cache-ram-gb", "inf", "allowed finite values >= 0"), ("--kv-cache-memory-gb", "inf", "finite"),
     ("--max-body-mb", "inf", "finite"), ("--grammar-compile-timeout", "-1", "allowed finite values > 0"),
     ("--grace-period", "-5", "allowed finite values >= 0"), ("--threads", "100000", "per logical CPU")],
)  # fmt: skip
def test_serve_values_past_what_can_run_are_one_line(folder: Path, flag: str, value: str, says: str) -> None:
    """inf passed every `>= 0` check and failed later in a traceback; a negative grammar timeout failed every
    grammar as the client's fault; 100000 threads segfaulted in torch's pool."""
    assert_one_line_error(run_cli("serve", str(folder), flag, value), value, says)


@pytest.mark.parametrize(
    "args", [["latency", "--repeat", "0"], ["throughput", "--num-prompts", "0"], ["probe", "--seconds", "-1"],
             ["probe", "--megabytes", "0"], ["compare", "--num-prompts", "-2"]],
)  # fmt: skip
def test_bench_counts_of_zero_are_one_line(args: list[str]) -> None:
    """A run of --repeat 0 recorded NaN, --num-prompts 0 a rate of 0.0, probe --seconds -1 a garbage peak."""
    assert_one_line_error(run_cli("bench", *args), f"argument {args[1]}", "invalid: allowed")


def test_serve_on_a_taken_port_is_one_line_before_the_model_loads(folder: Path) -> None:
    """The port is tried first: a taken one (another server) is one line and exit 2, before the model loads (at
    --log-level info a load would add its own line, and for a large model take minutes)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--log-level", "info")
    assert_one_line_error(proc, f"--port {port}", "Address already in use", "pick another --port")


def test_serve_whose_model_cannot_load_exits_instead_of_lying(folder: Path) -> None:
    """The engine cannot be built (a KV pool larger than any machine): one line and exit 2, not a listening
    server that answers "loading" forever."""
    proc = run_cli("serve", str(folder), "--port", "0", "--kv-cache-memory-gb", "100000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenmill serve: error: loading") and "allocate" in last, last


def test_api_key_comes_from_flag_file_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from tokenmill.server.launch import api_key

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    assert api_key(argparse.Namespace(api_key="from-flag", api_key_file=str(key_file))) == "from-flag"
    assert api_key(argparse.Namespace(api_key=None, api_key_file=str(key_file))) == "from-file"
    assert api_key(argparse.Namespace(api_key=None, api_key_file=None)) == "from-env"
    monkeypatch.delenv("TOKENMILL_API_KEY")
    assert api_key(argparse.Namespace(api_key=None, api_key_file=None)) is None
    key_file.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        api_key(argparse.Namespace(api_key=None, api_key_file=str(key_file)))


def test_every_engine_flag_says_what_it_does_and_its_default() -> None:
    import re
    from dataclasses import fields

    from tokenmill.config import EngineConfig

    options = run_cli("serve", "--help").stdout.split("options:", 1)[1]
    entries = {m.group(1): " ".join(m.group(2).split()) for m in re.finditer(r"^  (--[\w-]+)(.*?)(?=^  -|\Z)", options,
                                                                             re.M | re.S)}  # fmt: skip
    for f in fields(EngineConfig):
        if f.name in ("model", "seed"):
            continue
        entry = entries["--" + f.name.replace("_", "-")]
        assert len(entry.split()) > 3, entry  # a description, not just the metavar
        assert f.default is None or f"(default: {f.default})" in entry, entry


def test_scale_out_flag_errors_are_one_line(folder: Path) -> None:
    assert_one_line_error(run_cli("serve", str(folder), "--data-parallel-size", "0"), "--data-parallel-size=0")
    assert_one_line_error(run_cli("serve", str(folder), "--replica-max-restarts", "-1"), "--replica-max-restarts=-1")
    assert_one_line_error(run_cli("serve", str(folder), "--replica-restart-backoff", "0"),
                          "--replica-restart-backoff=0", "> 0")  # fmt: skip
    assert_one_line_error(run_cli("serve", str(folder), "--log-format", "xml"), "--log-format", "json")
    assert_one_line_error(run_cli("generate", str(folder), "--prompt", "x", "--tensor-parallel-size", "3"),
                          "tensor_parallel_size=3 does not divide this model")  # fmt: skip

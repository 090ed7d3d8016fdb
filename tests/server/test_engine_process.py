"""The engine in its own process (`tokenmill serve`'s default: engine/process_engine.py): the server's process never
loads torch; text, stop strings, samples, logprobs and usage come out as the engine makes them in one process;
and neither process outlives the other, nor leaves a request waiting when the other dies."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.server.helpers import Server, offline, running
from tokenmill import LLM
from tokenmill.bench.gguf_export import export_gguf

# decode runs of 4: a stop string is often found among tokens the engine made past it in the same step
SERVER_FLAGS = ("--num-scheduler-steps", "4")
PROMPT = "The quick brown fox"


def _engine_process(server: Server) -> psutil.Process:
    children = [p for p in psutil.Process(server.proc.pid).children() if "tokenmill.server.engine_process" in
                " ".join(p.cmdline())]  # fmt: skip
    assert len(children) == 1, [p.cmdline() for p in psutil.Process(server.proc.pid).children()]
    return children[0]


def _maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_the_server_process_never_loads_torch(checkpoint: Path, tmp_path: Path) -> None:
    """A GGUF's tokenizer is built from its metadata without transformers (a folder's too, where the lean tokenizer
    matches transformers'; the tiny checkpoint's does not, and transformers imports torch)."""
    gguf = export_gguf(checkpoint, tmp_path / "tiny-q8_0.gguf", "q8_0")
    with running(gguf, tmp_path, "--threads", "1") as server:
        engine = _engine_process(server)
        assert _maps_torch(engine.pid)
        assert not _maps_torch(server.proc.pid)
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": server.model, "prompt": PROMPT, "max_tokens": 4})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_stop_strings_end_each_sample_as_in_one_process(client: openai.OpenAI, server: Server, llm: LLM) -> None:
    """Three seeded samples with logprobs; stop strings taken from their own texts, so each stops at its own
    place (one that never appears in a sample lets it run to its length): every sample's text, tokens' logprobs,
    finish and stop reasons, and the usage, equal the offline engine's, which finds stop strings itself."""
    free = offline(llm, PROMPT, 24, temperature=1.0, seed=7, n=1)
    stops = [free.text[4:7], free.text[12:14]]
    assert all(stops), free.text
    kwargs: dict[str, Any] = {"temperature": 1.0, "seed": 7, "n": 3, "stop": stops, "logprobs": 2,
                              "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}  # fmt: skip
    want = llm.generate(PROMPT, _params(24, kwargs))[0].outputs
    got = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, **kwargs)
    assert [(c.text, c.finish_reason, c.stop_reason) for c in got.choices] == [
        (w.text, w.finish_reason, w.stop_reason) for w in want
    ]
    assert [len(c.logprobs.token_logprobs) for c in got.choices] == [len(w.token_ids) for w in want]
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert any(w.finish_reason == "stop" for w in want)
    streamed = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, stream=True,
                                         stream_options={"include_usage": True}, **kwargs)  # fmt: skip
    texts, usage = ["", "", ""], None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [w.text for w in want]
    assert usage is not None and usage.completion_tokens == got.usage.completion_tokens


def _params(max_tokens: int, kwargs: dict[str, Any]) -> Any:
    from tokenmill import SamplingParams

    extra = kwargs["extra_body"]
    return SamplingParams(max_tokens=max_tokens, temperature=kwargs["temperature"], seed=kwargs["seed"],
                          n=kwargs["n"], stop=kwargs["stop"], logprobs=kwargs["logprobs"], **extra)  # fmt: skip


def test_a_killed_engine_ends_open_streams_and_the_server_exits_1(checkpoint: Path, tmp_path: Path) -> None:
    with running(checkpoint, tmp_path, "--threads", "1") as server:
        engine = _engine_process(server)
        lines: list[str] = []
        failed: list[BaseException] = []

        def stream() -> None:
            body = {"model": server.model, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        lines.append(line)
                        if len(lines) == 2:
                            engine.send_signal(signal.SIGKILL)
            except httpx.HTTPError as e:
                failed.append(e)

        reader = threading.Thread(target=stream)
        reader.start()
        reader.join(60)
        assert not reader.is_alive(), "the stream hung after its engine died"
        assert failed or any("error" in line for line in lines), lines[-3:]
        assert server.proc.wait(30) == 1


def test_sigterm_to_the_whole_group_lets_the_stream_finish(checkpoint: Path, tmp_path: Path, llm: LLM) -> None:
    """systemd's stop and timeout(1) send SIGTERM to the server's whole process group, its engine process too: the
    engine leaves the stop to the server, which drains the open stream and exits 0 (the stream was cut with
    "the engine's process exited with status -15", and the server exited 1)."""
    want = offline(llm, PROMPT, 40).text
    with running(checkpoint, tmp_path, "--threads", "1") as server:
        engine = _engine_process(server)
        text, signalled = "", False
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 40, "stream": True, "ignore_eos": True,
                "temperature": 0}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                    if not signalled:  # both at once, as a group's signal reaches them
                        engine.send_signal(signal.SIGTERM)
                        server.proc.send_signal(signal.SIGTERM)
                        signalled = True
        assert text == want
        assert server.proc.wait(30) == 0


def test_a_killed_server_takes_its_engine_with_it(checkpoint: Path, tmp_path: Path) -> None:
    with running(checkpoint, tmp_path, "--threads", "1") as server:
        engine = _engine_process(server)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        engine.wait(10)  # psutil.TimeoutExpired if it outlived its server
        assert not engine.is_running()


def test_no_engine_process_serves_in_one_process(checkpoint: Path, tmp_path: Path, llm: LLM) -> None:
    with running(checkpoint, tmp_path, "--threads", "1", "--no-engine-process") as server:
        assert psutil.Process(server.proc.pid).children() == []
        assert _maps_torch(server.proc.pid)
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})  # fmt: skip
        assert r.json()["choices"][0]["text"] == offline(llm, PROMPT, 8).text


def test_a_model_that_cannot_load_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}')
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tokenmill", "serve", str(folder), "--port", "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("tokenmill serve: error:")]
    assert len(errors) == 1 and "NoSuchForCausalLM" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 120


def test_the_servers_memory_counts_its_engine(server: Server) -> None:
    """/metrics' resident memory is the server's processes', the engine's with it (most of it)."""
    engine = _engine_process(server).memory_info().rss
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("tokenmill:process_rss_bytes{"))
    assert float(line.split()[-1]) > engine


def _libtorch_code_rss(pid: int) -> int:
    """Resident bytes of libtorch_cpu's code (its r-xp mappings) in process `pid`."""
    maps = psutil.Process(pid).memory_maps(grouped=False)
    return sum(m.rss for m in maps if m.perms == "r-xp" and m.path.endswith("libtorch_cpu.so"))


def test_a_ready_engine_holds_no_more_of_torchs_code_than_it_runs(server: Server, client: openai.OpenAI) -> None:
    """The code torch's import ran once leaves the engine's resident set when it is ready (memory.py:
    release_code_pages); what serving runs comes back."""
    import subprocess
    import sys

    client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4)
    code = "import torch, sys; print('imported', flush=True); sys.stdin.read()"
    fresh = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert fresh.stdout is not None and fresh.stdout.readline().strip() == "imported"
        imported = _libtorch_code_rss(fresh.pid)  # what `import torch` alone leaves resident
    finally:
        fresh.communicate("")
    assert _libtorch_code_rss(_engine_process(server).pid) < 0.7 * imported

"""`tokenmill serve --tensor-parallel-size 2`: serves the same greedy tokens as one process through the openai
client; a worker rank that dies ends an in-flight stream with an error and the server exits non-zero within
seconds (as any engine death does, for a supervisor to restart), with one line saying so and no process left,
never a hang. Started by torchrun (one
process per rank, as across machines), rank 0 serves and rank 1 computes its shard."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil

from tests.server.helpers import Server, free_port, offline, running
from tests.server.hold import Hold
from tests.server.processes import assert_none_left, started_by
from tokenmill import LLM

SERVER_FLAGS = ("--tensor-parallel-size", "2", "--threads", "1")
HOLD_TOKEN = 8  # a prompt starting with it is held mid-request on rank 0 (tests/server/hold.py)


def _worker(server: Server) -> psutil.Process:
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    return next(
        p for p in kids if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    )


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_two_ranks_serve_and_a_dead_rank_ends_the_server(server: Server, llm: LLM, hold: Hold) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)
    prompts = [[11, 12, 13], [20, 21, 22, 23]]
    got = client.completions.create(model=server.model, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [
        offline(llm, {"prompt_token_ids": p}, 12, ignore_eos=False).text for p in prompts
    ]

    # held on rank 0 after its first tokens (tests/server/hold.py) until the worker is dead: unheld, a fast CPU
    # could finish the 400 tokens before the kill, and the stream would end without an error
    body = {"model": server.model, "prompt": [HOLD_TOKEN, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the stream is running
        hold.wait_held()
        started = started_by(server.proc.pid)
        worker = _worker(server)
        worker.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not _dead(worker):  # dead before the held step goes on
            assert time.monotonic() < deadline, "the worker survived SIGKILL for 30 s"
            time.sleep(0.01)
        hold.release()
        rest = [line for line in lines if line.startswith("data:")]
    assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
    start = time.monotonic()
    assert server.proc.wait(timeout=20) != 0
    assert time.monotonic() - start < 20
    assert_none_left(started, "a worker rank's death")  # the other ranks, the reaper and the resource tracker
    died = [line for line in server.log_tail(100_000).splitlines() if "the engine loop died" in line]
    assert len(died) == 1, server.log_tail()


def test_ranks_that_torchrun_started(checkpoint: Path, llm: LLM, tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-port", str(free_port()), "-m"]  # fmt: skip
    with running(checkpoint, tmp_path, "--tensor-parallel-size", "2", "--threads", "1", launcher=torchrun) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)
        prompt = [11, 12, 13]
        got = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == offline(llm, {"prompt_token_ids": prompt}, 12, ignore_eos=False).text

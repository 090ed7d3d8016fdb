"""One server that generates and embeds (`--task generate,embed`): embedding requests join the steps of running
generation streams, and neither changes the other: every stream's text is what the engine gives it alone, and every
vector is the offline engine's. The engine is held (tests/server/hold.py) while the requests queue, so they all start
in one step whatever the CPU's speed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai

from tests.server.helpers import Server, offline
from tests.server.hold import Hold
from tokenmill import LLM

SERVER_FLAGS = ("--task", "generate,embed")
HOLD_TOKEN = 8  # a prompt starting with it is held mid-request; no text prompt here does
PROMPTS = ["Hello world!", "To be, or not to be", "The quick brown fox", "Shall I compare"]
TEXTS = ["Numbers 0 1 2 3", "café 日本語", "Thou art more lovely and more temperate.", "a"]
MAX_TOKENS = 12
TOL = 1e-5


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: str | list[int]) -> str:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    return "".join([c.choices[0].text async for c in stream if c.choices])


async def _embed(client: openai.AsyncOpenAI, model: str, text: str) -> list[float]:
    return (await client.embeddings.create(model=model, input=text, encoding_format="float")).data[0].embedding


def _waiting(server: Server) -> int:
    return int(httpx.get(f"{server.url}/stats", timeout=30).json()["waiting"])


async def _mixed(server: Server, hold: Hold) -> tuple[str, list[str], list[list[float]]]:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0)
    held = asyncio.create_task(_stream(client, server.model, [HOLD_TOKEN, 5, 6, 7]))
    await asyncio.to_thread(hold.wait_held)
    streams = [asyncio.create_task(_stream(client, server.model, p)) for p in PROMPTS]
    vectors = [asyncio.create_task(_embed(client, server.model, t)) for t in TEXTS]
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(_waiting, server) < len(PROMPTS) + len(TEXTS):  # all queued behind the hold
        assert time.monotonic() < deadline, "the requests were not queued within 60 s"
        await asyncio.sleep(0.01)
    hold.release()
    return await held, list(await asyncio.gather(*streams)), list(await asyncio.gather(*vectors))


def test_embeddings_share_steps_with_streams_and_change_nothing(
    server: Server, hold: Hold, llm: LLM, checkpoint: Path
) -> None:
    held, texts, vectors = asyncio.run(_mixed(server, hold))
    assert held == offline(llm, {"prompt_token_ids": [HOLD_TOKEN, 5, 6, 7]}, MAX_TOKENS).text
    assert texts == [offline(llm, p, MAX_TOKENS).text for p in PROMPTS]
    expected = LLM(str(checkpoint), dtype="float32", task="generate,embed").embed(TEXTS)
    for got, want in zip(vectors, expected, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want.outputs.embedding, strict=True)) < TOL
    stats = httpx.get(f"{server.url}/stats", timeout=30).json()
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def test_the_mixed_benchmark_compares_each_streams_tpot_with_embeddings_beside(server: Server, tmp_path: Path) -> None:
    """`tokenmill bench serve --embed-rate R` (bench/mixed.py): the workload alone, then with embedding requests
    arriving beside it; each stream's TPOT in both runs and their ratio, and the embeddings' figures."""
    import argparse
    import json

    from tokenmill.bench.serve_args import add_serve_parser
    from tokenmill.bench.serve_run import run_serve

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    sizes = ["--num-prompts", "4", "--max-concurrency", "4", "--input-len", "8", "--output-len", "8"]
    beside = ["--embed-rate", "20", "--embed-batch", "2", "--embed-len", "6"]
    args = parser.parse_args(["serve", "--url", server.url, "--model", server.model, *sizes, *beside,
                              "--output-dir", str(tmp_path)])  # fmt: skip
    run = run_serve(args)
    summary = json.loads((run / "summary" / "summary.json").read_text())
    streams = json.loads((run / "raw" / "trials.json").read_text())
    assert run.name.startswith("mixed_") and summary["streams_compared"] == 4
    assert (tmp_path / summary["alone_run"] / "report.md").is_file() and summary["alone_run"] != summary["mixed_run"]
    assert all(s["ratio"] == s["tpot_mixed_ms"] / s["tpot_alone_ms"] > 0 for s in streams)
    assert summary["tpot_ratio_max"] == max(s["ratio"] for s in streams)
    embeddings = summary["embeddings"]
    assert embeddings["requests_sent"] >= 1 and embeddings["requests_errors"] == 0, embeddings["errors"]
    assert embeddings["prompt_token_throughput"] > 0 and "| stream | TPOT alone ms |" in (run / "report.md").read_text()

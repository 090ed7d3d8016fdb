"""Many concurrent streams through a real `tokenmill serve`, and a graceful SIGTERM.

The SIGTERM test stops this module's server, so it is the last test in the file (pytest keeps file order). Both
hold the engine (tests/server/hold.py) where they need requests to overlap, so no CPU is too fast for them.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import httpx
import openai

from tests.server.helpers import Server, offline
from tests.server.hold import Hold
from tokenmill import LLM

HOLD_TOKEN = 8  # a prompt starting with it is held mid-request (tests/server/hold.py); no text prompt here does

WORDS = ["Hello world!", "To be, or not to be", "The quick brown fox", "café", "Shall I compare", "Numbers 0 1 2"]
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 4)) + f" #{i}" for i in range(32)]
MAX_TOKENS = [3 + (i * 7) % 22 for i in range(32)]


def _client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0)


async def _stream(
    client: openai.AsyncOpenAI, server: Server, prompt: str | list[int], max_tokens: int
) -> tuple[str, str, int]:
    """(text, finish_reason, number of chunks) of one streamed greedy completion."""
    stream = await client.completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, reason, count = "", "", 0
    async for chunk in stream:
        count += 1
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason, count


def _stats(server: Server) -> dict[str, float]:
    r = httpx.get(f"{server.url}/stats", timeout=30)
    assert r.status_code == 200
    return dict(r.json())


def _wait_for_waiting(server: Server, count: int) -> None:
    deadline = time.monotonic() + 60
    while _stats(server)["waiting"] < count:
        assert time.monotonic() < deadline, f"{count} requests were not queued within 60 s"
        time.sleep(0.01)


def test_32_concurrent_streams_equal_sequential_greedy(server: Server, llm: LLM, hold: Hold) -> None:
    assert all(llm.tokenizer.encode(p)[0] != HOLD_TOKEN for p in PROMPTS)
    expected = [offline(llm, p, n).text for p, n in zip(PROMPTS, MAX_TOKENS)]  # each prompt run alone
    completed_before = _stats(server)["completed_requests"]

    async def main() -> list[tuple[str, str, int]]:
        async with _client(server) as client:
            # the engine is held while the 32 arrive, so they queue together and share its next steps
            first = asyncio.create_task(_stream(client, server, [HOLD_TOKEN, 5], 6))
            await asyncio.to_thread(hold.wait_held)
            streams = [asyncio.create_task(_stream(client, server, p, n)) for p, n in zip(PROMPTS, MAX_TOKENS)]
            await asyncio.to_thread(_wait_for_waiting, server, 32)
            hold.release()
            results = await asyncio.wait_for(asyncio.gather(*streams), timeout=180)
            assert (await first)[1] == "length"
            return results

    results = asyncio.run(main())
    assert [r[1] for r in results] == ["length"] * 32
    mismatches = [i for i, (got, want) in enumerate(zip((r[0] for r in results), expected)) if got != want]
    assert not mismatches, [(PROMPTS[i], results[i][0], expected[i]) for i in mismatches]
    stats = _stats(server)
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["completed_requests"] - completed_before == 33  # the held one too
    assert stats["max_batch_size"] >= 2, "32 concurrent requests never shared a batch"


def test_sigterm_lets_in_flight_request_finish_then_exits_0(server: Server, llm: LLM, hold: Hold) -> None:
    max_tokens, prompt = 300, [HOLD_TOKEN, *llm.tokenizer.encode(PROMPTS[0])]
    expected = offline(llm, {"prompt_token_ids": prompt}, max_tokens).text

    async def main() -> tuple[str, str | None, int]:
        async with _client(server) as client:
            stream = await client.completions.create(
                model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            text, reason, after_signal = "", None, 0
            async for chunk in stream:
                if text and not after_signal:  # the request is in flight, held: stop the server now, then let it go
                    await asyncio.to_thread(hold.wait_held)
                    server.proc.send_signal(signal.SIGTERM)
                    hold.release()
                after_signal += bool(text)
                for choice in chunk.choices:
                    text += choice.text
                    reason = choice.finish_reason or reason
            return text, reason, after_signal

    text, reason, after_signal = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert (text, reason) == (expected, "length"), "the in-flight request must complete during the grace period"
    assert after_signal > 1, "the request should still have been streaming when SIGTERM was sent"
    try:
        code = server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"server still running 30 s after SIGTERM; log:\n{server.log_tail()}") from None
    assert code == 0, f"exit status {code}; log:\n{server.log_tail()}"

"""`tokenmill serve --speculative-model ngram`: the same text as the offline engine without speculation, the
per-request draft counts in the /generate done event, and vLLM's speculative-decoding counters in /metrics. Its
prompts (~25 tokens) take two prefill steps of --max-num-batched-tokens 16 each."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.helpers import Server, offline, sse_events
from tests.server.test_http import _metrics, _value
from tokenmill import LLM

SERVER_FLAGS = ("--speculative-model", "ngram", "--num-speculative-tokens", "3", "--max-num-batched-tokens", "16")
PROMPT = "To be, or not to be, that is the question. To be, or not to be, that is the question. To be"


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_drafts_are_verified_counted_and_change_nothing(http: httpx.Client, llm: LLM) -> None:
    before = _metrics(http)
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        *chunks, done = sse_events(r.read().decode())
    assert "".join(json.loads(e["data"])["text"] for e in chunks) == offline(llm, PROMPT, 16, ignore_eos=False).text
    m = json.loads(done["data"])
    assert m["spec_draft_tokens"] > 0 and 0 <= m["spec_accepted_tokens"] <= m["spec_draft_tokens"]
    after = _metrics(http)
    drafted = _value(after, "tokenmill:spec_decode_num_draft_tokens_total")
    kept = _value(after, "tokenmill:spec_decode_num_accepted_tokens_total")
    assert drafted - _value(before, "tokenmill:spec_decode_num_draft_tokens_total") == m["spec_draft_tokens"]
    assert kept - _value(before, "tokenmill:spec_decode_num_accepted_tokens_total") == m["spec_accepted_tokens"]
    assert _value(after, "tokenmill:spec_decode_draft_acceptance_rate") == pytest.approx(kept / drafted)


def test_a_streamed_replys_timings_count_its_drafts(http: httpx.Client) -> None:
    """The final usage chunk's `timings` (docs/api.md) count the drafts of this request: what /generate reports."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with http.stream("POST", "/generate", json=body) as r:
        done = json.loads(sse_events(r.read().decode())[-1]["data"])
    stream = {**body, "model": http.get("/v1/models").json()["data"][0]["id"], "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=stream) as r:
        *_, last, end = sse_events(r.read().decode())
    assert end["data"] == "[DONE]"
    timings = json.loads(last["data"])["timings"]
    assert (timings["draft_tokens"], timings["accepted_tokens"]) == (done["spec_draft_tokens"],
                                                                    done["spec_accepted_tokens"])  # fmt: skip
    assert timings["draft_tokens"] > 0


def test_a_stream_sends_no_chunk_before_its_first_token(server: Server, llm: LLM) -> None:
    """A prompt over several prefill steps: no completions chunk goes out before the first token (a client stamps its
    TTFT at the first chunk), and the text and usage are the offline engine's."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)
    prompt = PROMPT + PROMPT  # ~50 tokens: four prefill steps
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, stream_options=options))  # type: ignore[arg-type]  # fmt: skip
    sent = [c for c in chunks if c.choices]
    assert sent and all(c.usage is not None and c.usage.completion_tokens >= 1 for c in sent)
    assert "".join(c.choices[0].text for c in sent) == offline(llm, prompt, 8, ignore_eos=False).text
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == len(llm.tokenizer.encode(prompt)) > 32

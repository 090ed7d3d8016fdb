"""`tokenmill serve --speculative-model ngram`: the same text as the offline engine without speculation, the
per-request draft counts in the /generate done event, and vLLM's speculative-decoding counters in /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.helpers import Server, offline, sse_events
from tests.server.test_http import _metrics, _value
from tokenmill import LLM

SERVER_FLAGS = ("--speculative-model", "ngram", "--num-speculative-tokens", "3")
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

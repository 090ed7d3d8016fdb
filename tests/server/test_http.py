"""Raw HTTP against a real `tokenmill serve`: SSE framing, error statuses, /generate, /metrics, /tokenize,
/stats, and aborting a request whose client disconnects mid-stream."""

from __future__ import annotations

import json
import math
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import Server, assert_openai_error, offline, offline_chat, sse_events, sse_json
from tests.server.hold import Hold
from tokenmill import LLM

SERVED_MODEL_NAME = "tiny"
HOLD_TOKEN = 8  # a prompt starting with it is held mid-request (tests/server/hold.py); no text prompt here does
PROMPT = "To be, or not to be"
MESSAGES = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _body(**overrides: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **overrides}


def test_health_and_models(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [SERVED_MODEL_NAME]
    assert body["data"][0]["object"] == "model"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sse_framing(http: httpx.Client, llm: LLM, path: str) -> None:
    chat = path.endswith("chat/completions")
    body = _body(max_tokens=6, stream=True, ignore_eos=True)
    if chat:
        del body["prompt"]
        body["messages"] = MESSAGES
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = sse_events(raw)
    assert all(list(e) == ["data"] for e in events), "every event is exactly one data: line"
    chunks = sse_json(events)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert len({c["id"] for c in chunks}) == 1 and all(c["model"] == SERVED_MODEL_NAME for c in chunks)
    if chat:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == offline_chat(llm, MESSAGES, 6).text
    else:
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == offline(llm, PROMPT, 6).text


@pytest.mark.parametrize(
    ("param", "value"),
    [("temperature", -1), ("top_p", 0), ("top_k", -5), ("n", 0), ("max_tokens", 0), ("logprobs", 99),
     ("presence_penalty", 5), ("repetition_penalty", 0), ("seed", "abc"), ("stop_token_ids", [-1]),
     ("temperature", 1e39), ("top_p", 1e-46)],
)  # fmt: skip
def test_invalid_value_is_400_naming_it(http: httpx.Client, param: str, value: Any) -> None:
    assert_openai_error(http.post("/v1/completions", json=_body(**{param: value})), 400, param)


CHAT_BAD_VALUES = [
    ({"temperature": -1}, "temperature"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"top_logprobs": 99}, "top_logprobs"),
    ({"messages": None}, "messages"),
    ({"max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("extra", "param"), CHAT_BAD_VALUES)
def test_invalid_chat_value_is_400_naming_it(http: httpx.Client, extra: dict[str, Any], param: str) -> None:
    body = {"model": SERVED_MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
    body = {k: v for k, v in body.items() if v is not None}  # None: leave the field out
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_parameter_is_400_naming_it(http: httpx.Client, path: str) -> None:
    chat = {"model": SERVED_MODEL_NAME, "messages": MESSAGES, "frobnicate": 1}
    body = _body(frobnicate=1) if path == "/v1/completions" else chat
    assert_openai_error(http.post(path, json=body), 400, "frobnicate")


POOLING = [
    ("/v1/embeddings", {"input": "Hello"}, "--task embed"),
    ("/v1/rerank", {"query": "Hello", "documents": ["world"]}, "--task score"),
    ("/v1/score", {"text_1": "Hello", "text_2": "world"}, "--task score"),
]


@pytest.mark.parametrize(("path", "body", "hint"), POOLING, ids=[p for p, _, _ in POOLING])
def test_pooling_a_generating_model_is_a_400_saying_how_to_serve_one(
    http: httpx.Client, path: str, body: dict[str, Any], hint: str
) -> None:
    assert_openai_error(http.post(path, json={"model": SERVED_MODEL_NAME, **body}), 400, hint)


PASS_THROUGH = [
    {"repetition_penalty": 1.5},
    {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "seed": 5, "top_p": 0.5, "top_k": 20, "min_p": 0.05},
    {"ignore_eos": False, "min_tokens": 6},
    {"user": "alice", "priority": 0},
]


@pytest.mark.parametrize("params", PASS_THROUGH, ids=lambda p: ",".join(p))
def test_sampling_parameters_reach_the_engine(http: httpx.Client, llm: LLM, params: dict[str, Any]) -> None:
    """The server's output equals the offline engine's for the same sampling parameters (none silently dropped)."""
    sampling = {k: v for k, v in params.items() if k not in ("user", "priority")}
    expected = offline(llm, PROMPT, 10, **sampling)
    r = http.post("/v1/completions", json=_body(max_tokens=10, **{"ignore_eos": True, **params}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected.text, expected.finish_reason)


def test_stop_token_ids(http: httpx.Client, llm: LLM) -> None:
    greedy = offline(llm, PROMPT, 10)
    stop_id = greedy.token_ids[3]
    expected = offline(llm, PROMPT, 10, stop_token_ids=[stop_id])
    assert expected.finish_reason == "stop"
    r = http.post("/v1/completions", json=_body(max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected.text, "stop")
    assert r.json()["usage"]["completion_tokens"] == len(expected.token_ids)


def test_malformed_json_is_400(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}
    )
    assert_openai_error(r, 400)


def test_prompt_too_long_uses_openai_wording(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=_body(prompt=[5] * 600, max_tokens=10))
    error = assert_openai_error(r, 400)
    want = (
        "This model's maximum context length is 512 tokens. However, you requested 610 tokens "
        "(600 in the messages, 10 in the completion)."
    )
    assert want in error["message"]
    assert error["code"] == "context_length_exceeded"  # (OpenAI's code, which clients look for)


def test_a_body_sent_as_another_content_type_is_told_to_send_json(http: httpx.Client) -> None:
    """`curl -d` sends form-encoded: the body is the right JSON, but FastAPI reads JSON only under its type."""
    body = json.dumps(_body(max_tokens=2)).encode()
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        assert_openai_error(http.post("/v1/completions", content=body, headers={"content-type": kind}), 400,
                            "Content-Type: application/json", kind)  # fmt: skip


def test_unknown_model_is_404(http: httpx.Client, server: Server) -> None:
    assert_openai_error(http.post("/v1/completions", json=_body(model="no-such-model")), 404, "no-such-model")
    r = http.post("/v1/chat/completions", json={"model": str(server.model) + "x", "messages": MESSAGES})
    assert_openai_error(r, 404)


def test_generate_done_event(http: httpx.Client, llm: LLM) -> None:
    with http.stream("POST", "/generate", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}) as r:
        assert r.status_code == 200
        events = sse_events(r.read().decode())
    *chunks, done = events
    assert done.get("event") == "done", f"last event should be `event: done`, got {done}"
    assert all("event" not in e for e in chunks)
    text = "".join(json.loads(e["data"])["text"] for e in chunks)
    assert text == offline(llm, PROMPT, 8, ignore_eos=False).text
    m = json.loads(done["data"])
    fields = ["prompt_tokens", "tokenization_ms", "ttft_ms", "prefill_ms", "stream_time_ms", "total_time_ms",
              "decode_tokens_per_sec", "rss_start_mb", "peak_rss_mb", "rss_end_mb"]  # fmt: skip
    for name in fields:
        assert isinstance(m.get(name), int | float) and math.isfinite(m[name]) and m[name] >= 0, (name, m)
    assert m["prompt_tokens"] == len(llm.tokenizer.encode(PROMPT))
    assert m["ttft_ms"] > 0 and m["total_time_ms"] >= m["ttft_ms"] and m["rss_end_mb"] > 0
    assert m["peak_rss_mb"] >= 0.95 * max(m["rss_start_mb"], m["rss_end_mb"])


def _metrics(http: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (other labels, e.g. model_name, ignored)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert found, f"no sample {name}{labels or ''} in /metrics: {sorted({n for n, _ in samples})}"
    return sum(found)


def test_streamed_samples_end_once_and_carry_every_logprob(http: httpx.Client) -> None:
    """n = 3 drawn samples that stop at different steps (a stop string): each choice gets exactly one chunk with a
    finish_reason, however many steps its siblings still take; and the streamed chunks carry every token's logprob,
    those of tokens whose text was held back (a partial character, a possible stop string) included, and the same
    text as without streaming."""
    body = _body(max_tokens=30, temperature=1.0, seed=5, n=3, stop=["e"], logprobs=1)
    plain = http.post("/v1/completions", json=body).json()["choices"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = sse_json(sse_events(r.read().decode()))
    ends = [c for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in ends) == [0, 1, 2]
    # vLLM's stop_reason: the stop string that ended a choice, in its last chunk and unstreamed alike
    assert {c["index"]: c["stop_reason"] for c in ends} == {c["index"]: c["stop_reason"] for c in plain}
    assert all(c["stop_reason"] == ("e" if c["finish_reason"] == "stop" else None) for c in plain)
    lengths = {len(c["logprobs"]["tokens"]) for c in plain}
    assert len(lengths) > 1  # the samples ended at different steps, so the check above means something
    for want in plain:
        got = [c for chunk in chunks for c in chunk["choices"] if c["index"] == want["index"]]
        assert "".join(c["text"] for c in got) == want["text"]
        streamed = [t for c in got if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert streamed == want["logprobs"]["tokens"]


def test_metrics_counters_move(http: httpx.Client, llm: LLM) -> None:
    before = _metrics(http)
    r = http.post("/v1/completions", json=_body(max_tokens=5, ignore_eos=True))
    assert r.status_code == 200
    after = _metrics(http)

    def delta(name: str, **labels: str) -> float:  # a labelled series appears with its first request
        earlier = [v for (n, ls), v in before.items() if n == name and set(labels.items()) <= ls]
        return _value(after, name, **labels) - sum(earlier)

    assert delta("tokenmill:prompt_tokens_total") == len(llm.tokenizer.encode(PROMPT))
    assert delta("tokenmill:generation_tokens_total") == 5
    assert delta("tokenmill:request_success_total", finished_reason="length") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"tokenmill:{hist}_count") == 1, hist
    assert delta("tokenmill:inter_token_latency_seconds_count") == 4  # a gap after each token but the first
    assert delta("tokenmill:request_time_per_output_token_seconds_count") == 1
    assert delta("tokenmill:request_time_per_output_token_seconds_sum") > 0
    assert _value(after, "tokenmill:num_requests_running") == 0
    assert _value(after, "tokenmill:num_requests_waiting") == 0
    assert 0 <= _value(after, "tokenmill:kv_cache_usage_perc") <= 1
    for name in ("tokenmill:prefix_cache_queries_total", "tokenmill:prefix_cache_hits_total",
                 "tokenmill:num_preemptions_total"):  # fmt: skip
        _value(after, name)
    names = {n for n, _ in after}
    assert any(re.search(r"(rss|resident_memory)", n) for n in names), "process RSS metric"
    assert any(re.search(r"cpu", n) for n in names), "process CPU metric"


def test_the_collector_runs_once_the_model_has_loaded(http: httpx.Client) -> None:
    """`serve` pauses Python's cyclic collector while it imports and loads (tokenmill/memory.py); once its one model
    has loaded, the objects alive then are frozen out of its sight and it runs again, or cycles made while serving
    would never be collected."""
    samples = _metrics(http)
    assert _value(samples, "tokenmill:python_gc_enabled") == 1
    assert _value(samples, "tokenmill:python_gc_frozen_objects") > 10_000  # (torch's modules alone are more)
    assert _value(samples, "python_gc_collections_total", generation="0") >= 0  # prometheus_client's GCCollector


def test_tokenize_detokenize_round_trip(http: httpx.Client, llm: LLM) -> None:
    r = http.post("/tokenize", json={"model": SERVED_MODEL_NAME, "prompt": PROMPT})
    assert r.status_code == 200
    body = r.json()
    want = llm.tokenizer.encode(PROMPT)
    assert (body["tokens"], body["count"], body["max_model_len"]) == (want, len(want), 512)
    r = http.post("/detokenize", json={"model": SERVED_MODEL_NAME, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == PROMPT
    r = http.post("/tokenize", json={"model": SERVED_MODEL_NAME, "messages": MESSAGES})
    assert r.status_code == 200 and r.json()["tokens"] == llm.tokenizer.apply_chat_template(MESSAGES)
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert bare == llm.tokenizer.apply_chat_template(MESSAGES, False) != r.json()["tokens"]  # (vLLM's field)
    assert_openai_error(http.post("/tokenize", json={"prompt": PROMPT, "messages": MESSAGES}), 400, "not both")


def _stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/stats")
    assert r.status_code == 200
    return dict(r.json())


def test_stats_snapshot(http: httpx.Client) -> None:
    stats = _stats(http)
    keys = {"running", "waiting", "kv_blocks_used", "kv_blocks_free", "prefix_cache_hit_rate", "avg_batch_size",
            "max_batch_size", "completed_requests", "preemptions"}  # fmt: skip
    assert keys <= set(stats), keys - set(stats)
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["kv_blocks_free"] > 0 and stats["completed_requests"] > 0
    assert 0 <= stats["prefix_cache_hit_rate"] <= 1


def _wait_until_aborted(http: httpx.Client, baseline: int) -> dict[str, Any]:
    """The server's stats once nothing runs and the KV blocks in use are back to `baseline` (10 s at most)."""
    deadline = time.monotonic() + 10
    while (stats := _stats(http))["running"] != 0 or stats["kv_blocks_used"] != baseline:
        assert time.monotonic() < deadline, f"request not aborted 10 s after the disconnect: {stats}"
        time.sleep(0.05)  # bounded polling
    return stats


def test_disconnect_aborts_and_frees_kv(http: httpx.Client, hold: Hold) -> None:
    baseline = _stats(http)["kv_blocks_used"]
    generated_before = _value(_metrics(http), "tokenmill:generation_tokens_total")
    max_tokens = 480  # with a 512-token context: far more than what streams before the client hangs up
    # the engine is held after the request's first tokens until the server aborts it (tests/server/hold.py), so the
    # request is unfinished when the client leaves however fast this CPU is (an unheld one raced the client)
    body = _body(prompt=[HOLD_TOKEN, 30, 31], max_tokens=max_tokens, ignore_eos=True, stream=True)
    try:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped line iterator closes the response
            assert next(line for line in lines if line.startswith("data: "))
            hold.wait_held()
        # the response is closed: the server must abort the request within an engine step and free its blocks
        _wait_until_aborted(http, baseline)
    finally:
        hold.release()  # a no-op once the abort ended the hold
    generated = _value(_metrics(http), "tokenmill:generation_tokens_total") - generated_before
    assert generated < max_tokens, "the request ran to completion instead of being aborted"
    assert http.get("/health").status_code == 200


def test_non_streaming_disconnect_aborts_too(server: Server, http: httpx.Client, hold: Hold) -> None:
    before = _stats(http)
    baseline = before["kv_blocks_used"]
    # 8 choices of 480 tokens; the engine is held after their first tokens until the server aborts them
    # (tests/server/hold.py; the server looks for a gone client every 0.1 s), and the client leaves once it is
    # held: the request is still running when the client leaves and when the server notices, on any CPU
    payload = json.dumps(_body(prompt=[HOLD_TOKEN, 40, 41], max_tokens=480, ignore_eos=True, n=8)).encode()
    url = httpx.URL(server.url)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    try:
        with socket.create_connection((url.host, url.port)) as client:
            client.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            hold.wait_held()
            assert _stats(http)["running"] != 0
        # the connection is closed: the server must abort the request and free its blocks
        stats = _wait_until_aborted(http, baseline)
    finally:
        hold.release()  # a no-op once the abort ended the hold
    assert stats["aborted_requests"] == before["aborted_requests"] + 1
    assert stats["completed_requests"] == before["completed_requests"]


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server: Server, http: httpx.Client) -> None:
    """While a ~3.6 MB prompt is tokenized (~5 s here), /health keeps answering; then the prompt gets its 400.

    On a blocked event loop one /health would wait out nearly the whole tokenization; here none waits even
    half as long as the big request takes (durations from the same run compared, not a fixed bound)."""
    import threading

    big = {"model": SERVED_MODEL_NAME, "prompt": "Shall I compare thee to a summer's day? " * 90_000, "max_tokens": 2}
    done = threading.Event()
    result: dict[str, Any] = {}

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            start = time.perf_counter()
            result["big"] = client.post("/v1/completions", json=big)
            result["seconds"] = time.perf_counter() - start
            done.set()

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while not done.is_set():
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        waits.append(time.perf_counter() - start)
    sender.join()
    assert_openai_error(result["big"], 400, "maximum context length")
    assert max(waits) < result["seconds"] / 2, (max(waits), result["seconds"])

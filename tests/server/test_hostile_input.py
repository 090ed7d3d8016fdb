"""Hostile requests over every route: wrong types, out-of-range and non-finite numbers, oversize and malformed
bodies, lone surrogates, deep nesting, unbounded n and prompt lists, bad chat roles and parts.

Each must get its own clear 4xx (never a 500, never a hang), the server must stay healthy, and a reference
greedy request must produce exactly what it produced before the barrage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.helpers import Server

SERVED_MODEL_NAME = "tiny"
SERVER_FLAGS = ("--max-waiting-requests", "64", "--max-n", "16", "--max-prompts", "8", "--max-body-mb", "0.25")
VOCAB = 384  # the tiny checkpoint's vocab_size
REFERENCE = {"model": SERVED_MODEL_NAME, "prompt": "To be, or not to be", "max_tokens": 8, "temperature": 0,
             "ignore_eos": True}  # fmt: skip
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **fields}


# (id, method, path, JSON body or raw bytes, expected status)
CASES: list[tuple[str, str, str, Any, int]] = [
    # -- completions: types and ranges of every sampling field
    ("temperature-nan", "POST", CMPL, b'{"prompt": "Hi", "max_tokens": 2, "temperature": NaN}', 400),
    ("temperature-inf", "POST", CMPL, b'{"prompt": "Hi", "max_tokens": 2, "temperature": Infinity}', 400),
    ("temperature-neg-inf", "POST", CMPL, b'{"prompt": "Hi", "max_tokens": 2, "temperature": -Infinity}', 400),
    ("temperature-string", "POST", CMPL, cmpl(temperature="hot"), 400),
    ("temperature-bool", "POST", CMPL, cmpl(temperature=True), 400),
    ("temperature-negative", "POST", CMPL, cmpl(temperature=-0.5), 400),
    ("top-p-zero", "POST", CMPL, cmpl(top_p=0), 400),
    ("top-p-above-one", "POST", CMPL, cmpl(top_p=1.5), 400),
    ("top-k-past-64-bits", "POST", CMPL, cmpl(top_k=2**70), 400),
    ("top-k-past-int32", "POST", CMPL, cmpl(top_k=2**40), 400),
    ("top-k-minus-two", "POST", CMPL, cmpl(top_k=-2), 400),
    ("top-k-float", "POST", CMPL, cmpl(top_k=1.5), 400),
    ("min-p-above-one", "POST", CMPL, cmpl(min_p=2), 400),
    ("seed-past-64-bits", "POST", CMPL, cmpl(seed=2**64), 400),
    ("seed-below-64-bits", "POST", CMPL, cmpl(seed=-(2**70)), 400),
    ("seed-string", "POST", CMPL, cmpl(seed="1"), 400),
    ("max-tokens-bool", "POST", CMPL, cmpl(max_tokens=True), 400),
    ("max-tokens-zero", "POST", CMPL, cmpl(max_tokens=0), 400),
    ("max-tokens-zero-echo-streamed", "POST", CMPL, cmpl(max_tokens=0, echo=True, stream=True), 400),
    ("stream-options-without-stream", "POST", CMPL, cmpl(stream_options={"include_usage": True}), 400),
    ("max-tokens-float", "POST", CMPL, cmpl(max_tokens=1.5), 400),
    ("max-tokens-past-64-bits", "POST", CMPL, cmpl(max_tokens=2**64), 400),
    ("max-tokens-past-context", "POST", CMPL, cmpl(max_tokens=10_000), 400),
    ("min-tokens-negative", "POST", CMPL, cmpl(min_tokens=-1), 400),
    ("min-tokens-above-max", "POST", CMPL, cmpl(min_tokens=5), 400),
    ("n-zero", "POST", CMPL, cmpl(n=0), 400),
    ("n-above-max-n", "POST", CMPL, cmpl(n=17), 400),
    ("n-huge", "POST", CMPL, cmpl(n=100_000_000), 400),
    ("n-bool", "POST", CMPL, cmpl(n=True), 400),
    ("logprobs-21", "POST", CMPL, cmpl(logprobs=21), 400),
    ("logprobs-negative", "POST", CMPL, cmpl(logprobs=-1), 400),
    ("presence-penalty-3", "POST", CMPL, cmpl(presence_penalty=3), 400),
    ("frequency-penalty-nan", "POST", CMPL, b'{"prompt": "Hi", "max_tokens": 2, "frequency_penalty": NaN}', 400),
    ("repetition-penalty-zero", "POST", CMPL, cmpl(repetition_penalty=0), 400),
    ("repetition-penalty-nan", "POST", CMPL, b'{"prompt": "Hi", "max_tokens": 2, "repetition_penalty": NaN}', 400),
    ("stop-17-strings", "POST", CMPL, cmpl(stop=[f"s{i}" for i in range(17)]), 400),
    ("stop-empty-string", "POST", CMPL, cmpl(stop=[""]), 400),
    ("stop-number", "POST", CMPL, cmpl(stop=[1]), 400),
    ("stop-lone-surrogate", "POST", CMPL, b'{"prompt": "Hi", "max_tokens": 2, "stop": "\\ud800"}', 400),
    ("stop-token-negative", "POST", CMPL, cmpl(stop_token_ids=[-1]), 400),
    ("stop-token-past-vocab", "POST", CMPL, cmpl(stop_token_ids=[VOCAB], min_tokens=1), 400),
    ("stop-token-huge", "POST", CMPL, cmpl(stop_token_ids=[2**40]), 400),
    ("priority-past-64-bits", "POST", CMPL, cmpl(priority=2**64), 400),
    ("stream-string", "POST", CMPL, cmpl(stream="yes"), 400),
    ("stream-options-unknown", "POST", CMPL, cmpl(stream=True, stream_options={"foo": 1}), 400),
    ("unknown-field", "POST", CMPL, cmpl(best_of=2), 400),
    # -- completions: prompts
    ("prompt-empty-string", "POST", CMPL, cmpl(prompt=""), 400),
    ("prompt-empty-list", "POST", CMPL, cmpl(prompt=[]), 400),
    ("prompt-empty-token-list", "POST", CMPL, cmpl(prompt=[[]]), 400),
    ("prompt-negative-token", "POST", CMPL, cmpl(prompt=[-1]), 400),
    ("prompt-token-past-vocab", "POST", CMPL, cmpl(prompt=[VOCAB]), 400),
    ("prompt-token-huge", "POST", CMPL, cmpl(prompt=[10**12]), 400),
    ("prompt-mixed-list", "POST", CMPL, cmpl(prompt=[1, "a"]), 400),
    ("prompt-nested-3", "POST", CMPL, cmpl(prompt=[[[1]]]), 400),
    ("prompt-object", "POST", CMPL, cmpl(prompt={"a": 1}), 400),
    ("prompt-null", "POST", CMPL, cmpl(prompt=None), 400),
    ("prompt-missing", "POST", CMPL, {"model": SERVED_MODEL_NAME, "max_tokens": 2}, 400),
    ("prompt-lone-surrogate", "POST", CMPL, b'{"prompt": "a\\udc00b", "max_tokens": 2}', 400),
    ("prompt-list-past-max-prompts", "POST", CMPL, cmpl(prompt=["Hi"] * 9), 400),
    ("prompts-times-n-past-queue", "POST", CMPL, cmpl(prompt=["Hi"] * 8, n=9), 400),
    # -- bodies
    ("body-malformed", "POST", CMPL, b'{"prompt": "Hi", ', 400),
    ("body-empty", "POST", CMPL, b"", 400),
    ("body-array", "POST", CMPL, b"[]", 400),
    ("body-string", "POST", CMPL, b'"prompt"', 400),
    ("body-invalid-utf8", "POST", CMPL, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400),
    ("body-deep-nesting", "POST", CMPL, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
    ("body-too-large", "POST", CMPL, cmpl(prompt="x" * 300_000), 413),
    ("model-unknown", "POST", CMPL, cmpl(model="gpt-4"), 404),
    # -- chat
    ("chat-no-messages", "POST", CHAT, chat(messages=[]), 400),
    ("chat-messages-string", "POST", CHAT, chat(messages="hi"), 400),
    ("chat-role-robot", "POST", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400),
    ("chat-content-number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400),
    (
        "chat-image-part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
    ),
    (
        "chat-text-part-without-text",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
    ),
    ("chat-name-number", "POST", CHAT, chat(messages=[{"role": "user", "content": "hi", "name": 5}]), 400),
    (
        "chat-lone-surrogate",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
        400,
    ),
    ("chat-top-logprobs-21", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400),
    ("chat-logprobs-int", "POST", CHAT, chat(logprobs=1), 400),
    ("chat-max-completion-tokens-zero", "POST", CHAT, chat(max_completion_tokens=0), 400),
    ("chat-n-above-max-n", "POST", CHAT, chat(n=17), 400),
    (
        "chat-temperature-nan",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
    ),
    # -- the other routes
    ("tokenize-nothing", "POST", "/tokenize", {}, 400),
    ("tokenize-lone-surrogate", "POST", "/tokenize", b'{"prompt": "\\udfff"}', 400),
    ("tokenize-bad-role", "POST", "/tokenize", {"messages": [{"role": "x", "content": "y"}]}, 400),
    ("detokenize-negative", "POST", "/detokenize", {"tokens": [-1]}, 400),
    ("detokenize-past-vocab", "POST", "/detokenize", {"tokens": [VOCAB]}, 400),
    ("detokenize-strings", "POST", "/detokenize", {"tokens": ["a"]}, 400),
    ("generate-lone-surrogate", "POST", "/generate", b'{"prompt": "\\ud800"}', 400),
    ("generate-max-tokens-bool", "POST", "/generate", {"prompt": "Hi", "max_tokens": True}, 400),
    ("generate-temperature-inf", "POST", "/generate", b'{"prompt": "Hi", "temperature": Infinity}', 400),
    ("wrong-method", "GET", CMPL, None, 405),
    ("unknown-path", "POST", "/v1/engines", {}, 404),
]


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http: httpx.Client) -> str:
    """The reference greedy completion, taken before any hostile request."""
    r = http.post(CMPL, json=REFERENCE)
    assert r.status_code == 200
    return str(r.json()["choices"][0]["text"])


def test_there_are_at_least_sixty_cases() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("method", "path", "body", "status"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request_gets_a_clear_4xx(
    http: httpx.Client, reference: str, method: str, path: str, body: Any, status: int
) -> None:
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.request(method, path, json=body)
    assert r.status_code == status, f"{r.status_code}: {r.text[:300]}"
    error = r.json().get("error") or r.json().get("detail")
    assert error, r.text[:300]
    if isinstance(error, dict):
        assert error["message"] and "Traceback" not in error["message"]
    assert http.get("/health").status_code == 200


def test_after_the_barrage_the_server_is_healthy_and_unchanged(http: httpx.Client, reference: str) -> None:
    assert http.get("/health").status_code == 200
    r = http.post(CMPL, json=REFERENCE)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference
    stats = http.get("/stats").json()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["failed_requests"] == 0


def test_a_tiny_temperature_is_greedy_not_nan(http: httpx.Client, reference: str) -> None:
    r = http.post(CMPL, json={**REFERENCE, "temperature": 1e-45})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference


def test_the_error_names_the_parameter(http: httpx.Client) -> None:
    for field, value in (("top_k", 2**70), ("seed", 2**64), ("n", 17), ("max_tokens", True)):
        error = http.post(CMPL, json=cmpl(**{field: value})).json()["error"]
        assert error["param"] == field or field in error["message"], error
    error = http.post(CMPL, content=json.dumps(cmpl(prompt="\ud800")), headers={"content-type": "application/json"})
    assert "surrogate" in error.json()["error"]["message"]

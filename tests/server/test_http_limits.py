"""A server started with `--api-key`, a tiny waiting queue and no web page: 401 without the right bearer token (or
x-api-key), and overload refused with 503 + Retry-After instead of being queued without bound; under /v1/messages
both in Anthropic's error shape."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tests.server.helpers import Server, assert_openai_error
from tests.server.hold import Hold

KEY = "sekret-key"
SERVER_FLAGS = ("--api-key", KEY, "--max-waiting-requests", "1", "--max-num-seqs", "1", "--no-web-ui")
SERVED_MODEL_NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
HOLD_TOKEN = 8  # a prompt starting with it is held mid-request (tests/server/hold.py)
COMPLETION = {"model": SERVED_MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
CHAT = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}],
    ids=["missing", "wrong", "no-bearer-scheme", "key-prefix"],
)
def test_missing_or_wrong_key_is_401(http: httpx.Client, headers: dict[str, str]) -> None:
    r = http.post("/v1/completions", json=COMPLETION, headers=headers)
    assert_openai_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(http.post("/v1/chat/completions", json=CHAT, headers=headers), 401)
    assert_openai_error(http.get("/v1/models", headers=headers), 401)
    for path in ("/docs", "/openapi.json", "/stats"):  # the docs follow the key unless --public-docs
        assert_openai_error(http.get(path, headers=headers), 401)


def test_the_key_is_checked_before_the_body_is_read(http: httpx.Client) -> None:
    raw = {"content-type": "application/json"}
    assert_openai_error(http.post("/v1/completions", content=b'{"prompt": ', headers=raw), 401)  # malformed
    huge = b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}'  # past the 4 MiB default body limit
    assert_openai_error(http.post("/v1/completions", content=huge, headers=raw), 401)
    assert_openai_error(http.post("/v1/completions", content=huge, headers={**raw, **AUTH}), 413)
    assert http.get("/openapi.json", headers=AUTH).status_code == 200


def test_without_the_web_ui_its_paths_are_neither_open_nor_served(http: httpx.Client) -> None:
    for path in ("/", "/ui/app.js"):
        assert_openai_error(http.get(path), 401)  # no longer open paths: the key comes first
        assert http.get(path, headers=AUTH).status_code == 404


def test_right_key_is_served(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=COMPLETION, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = http.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == SERVED_MODEL_NAME
    assert http.get("/health").status_code == 200  # probes need no key


def test_full_waiting_queue_is_503_with_retry_after(server: Server, http: httpx.Client, hold: Hold) -> None:
    # one running (--max-num-seqs 1) + one waiting (--max-waiting-requests 1): of 5 long requests sent at once
    # beside the running one, exactly one is queued and the others are refused at once instead of queued. The
    # running one is held mid-request until they are answered (tests/server/hold.py): unheld, it raced them
    long = {**COMPLETION, "max_tokens": 200, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as client:
            running = asyncio.create_task(client.post("/v1/completions", json={**long, "prompt": [HOLD_TOKEN, 20]}))
            await asyncio.to_thread(hold.wait_held)
            rest = [asyncio.create_task(client.post("/v1/completions", json=long)) for _ in range(5)]
            refused = []
            for answered in asyncio.as_completed(rest):  # the refusals come while the engine is still held
                refused.append(await answered)
                if len(refused) == 4:
                    break
            assert hold.is_held and all(r.status_code == 503 for r in refused), [r.status_code for r in refused]
            hold.release()
            return [await running, *await asyncio.gather(*rest)]

    try:
        responses = asyncio.run(main())
    finally:
        hold.release()
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 503, 503, 503, 503], statuses
    for r in responses:
        if r.status_code == 503:
            assert_openai_error(r, 503)
            assert r.headers.get("retry-after", "").strip().isdigit(), r.headers
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    # overload passed: the server serves again
    r = http.post("/v1/completions", json=COMPLETION, headers=AUTH)
    assert r.status_code == 200
    stats = http.get("/stats", headers=AUTH).json()
    assert stats["running"] == stats["waiting"] == 0


def test_a_request_that_can_never_be_queued_is_400_not_503(http: httpx.Client) -> None:
    """n=2 against --max-waiting-requests 1 would get "retry later" forever; it is the client's to change."""
    error = assert_openai_error(http.post("/v1/completions", json={**COMPLETION, "n": 2}, headers=AUTH), 400, "n")
    assert "queues at most 1" in error["message"]


# -- Anthropic's clients: the x-api-key header and Anthropic's error shape under /v1/messages ----------------------
MESSAGE = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}


def _anthropic_error(resp: httpx.Response, status: int, kind: str) -> None:
    assert resp.status_code == status, resp.text[:300]
    assert resp.json() == {"type": "error", "error": {"type": kind, "message": resp.json()["error"]["message"]}}


def test_x_api_key_is_taken_like_a_bearer_key(server: Server, http: httpx.Client) -> None:
    for headers in ({}, {"x-api-key": "wrong-key"}, {"x-api-key": f"Bearer {KEY}"}, {"authorization": KEY}):
        _anthropic_error(http.post("/v1/messages", json=MESSAGE, headers=headers), 401, "authentication_error")
        _anthropic_error(http.post("/v1/messages/count_tokens", json=MESSAGE, headers=headers), 401,
                         "authentication_error")  # fmt: skip
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=60, max_retries=0)
    assert client.messages.create(**MESSAGE).usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**MESSAGE)
    # either header opens every endpoint
    assert http.post("/v1/messages", json=MESSAGE, headers=AUTH).status_code == 200
    assert http.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY}).status_code == 200
    huge = b'{"model": "' + b"x" * (5 * 2**20) + b'"}'  # past the 4 MiB default body limit
    raw = {"content-type": "application/json", "x-api-key": KEY}
    _anthropic_error(http.post("/v1/messages", content=huge, headers=raw), 413, "request_too_large")


def test_a_full_queue_is_overloaded_error_on_messages(server: Server, http: httpx.Client, hold: Hold) -> None:
    long = {**COMPLETION, "max_tokens": 200, "ignore_eos": True}

    async def main() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as client:
            running = asyncio.create_task(client.post("/v1/completions", json={**long, "prompt": [HOLD_TOKEN, 20]}))
            await asyncio.to_thread(hold.wait_held)
            queued = asyncio.create_task(client.post("/v1/completions", json=long))
            while (await client.get("/stats")).json()["waiting"] < 1:  # until it waits (bounded by the hold's)
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/messages", json=MESSAGE)
            hold.release()
            return refused, [await running, await queued]

    try:
        refused, served = asyncio.run(main())
    finally:
        hold.release()
    _anthropic_error(refused, 503, "overloaded_error")
    assert refused.headers.get("retry-after", "").strip().isdigit()
    assert [r.status_code for r in served] == [200, 200]

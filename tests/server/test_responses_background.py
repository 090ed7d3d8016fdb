"""Background responses (`background: true`) with the `openai` SDK against a real server: the create call answers
at once and the generation runs on in the server; retrieve, cancel, resumed streams, and the store dropping a
running one. The engine holds every request of this module's server after its first steps (HOLD_TOKEN is the chat
template's first token; tests/server/hold.py) until the test releases it or the server aborts it, so a response is
still running while a test looks at it, on a CPU of any speed."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import openai
import pytest

from tests.server.helpers import Server, sse_events
from tests.server.hold import Hold

HOLD_TOKEN = 1  # <|im_start|>, with which the chat template starts every prompt
# no prefix caching: a prompt seen before would start past its cached blocks, and the hold looks at its first token
SERVER_FLAGS = ("--responses-store-size", "3", "--no-enable-prefix-caching")
ASK: dict[str, Any] = {"input": "Hello world!", "max_output_tokens": 12, "temperature": 0}
RUNNING = ("queued", "in_progress")
T = TypeVar("T")


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c  # type: ignore[misc]


def test_every_prompt_starts_with_the_hold_token(http: httpx.Client, server: Server) -> None:
    messages = [{"role": "user", "content": "Hello world!"}]
    ids = http.post("/tokenize", json={"model": server.model, "messages": messages}).json()["tokens"]
    assert ids[0] == HOLD_TOKEN


def _released(hold: Hold, work: Callable[[], T]) -> T:
    """`work`'s result, run in a thread while this one ends the hold its request runs into."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(work)
        hold.wait_held()
        hold.release()
        return future.result()


def _finished(client: openai.OpenAI, response_id: str, hold: Hold) -> Any:
    """The response once it has ended (60 s at most), releasing any hold on the way."""
    deadline = time.monotonic() + 60
    while (r := client.responses.retrieve(response_id)).status in RUNNING:
        assert time.monotonic() < deadline, f"{response_id} still {r.status} after 60 s"
        hold.release()
        time.sleep(0.02)  # bounded polling
    return r


def _settled(http: httpx.Client) -> dict[str, Any]:
    """The server's stats once nothing runs and every KV block is back (10 s at most)."""
    deadline = time.monotonic() + 10
    while (stats := http.get("/stats").json())["running"] != 0 or stats["kv_blocks_used"] != 0:
        assert time.monotonic() < deadline, f"requests still running or blocks still held after 10 s: {stats}"
        time.sleep(0.05)  # bounded polling
    return dict(stats)


def _usage(r: Any) -> tuple[int, int]:
    return r.usage.input_tokens, r.usage.output_tokens


def test_a_background_response_runs_on_in_the_server_and_ends_as_a_foreground_one(
    client: openai.OpenAI, server: Server, hold: Hold
) -> None:
    foreground = _released(hold, lambda: client.responses.create(model=server.model, **ASK))
    assert foreground.status == "incomplete"  # it runs to its budget: no end of text within the hold's steps
    r = client.responses.create(model=server.model, **ASK, background=True)
    assert (r.status, r.background, r.output, r.usage) == ("queued", True, [], None)
    hold.wait_held()  # the engine holds it mid-way: it cannot have ended
    assert client.responses.retrieve(r.id).status in RUNNING
    with pytest.raises(openai.BadRequestError, match="still running"):
        client.responses.create(model=server.model, **ASK, previous_response_id=r.id)
    hold.release()
    done = _finished(client, r.id, hold)
    assert (done.status, done.output_text, _usage(done)) == ("incomplete", foreground.output_text, _usage(foreground))
    assert [o.type for o in done.output] == ["message"] and done.background
    assert client.responses.cancel(r.id).model_dump() == done.model_dump()  # a finished one comes back as it is


def test_cancel_aborts_a_running_background_response_and_frees_its_kv_blocks(
    client: openai.OpenAI, server: Server, http: httpx.Client, hold: Hold
) -> None:
    before = _settled(http)
    r = client.responses.create(model=server.model, **{**ASK, "max_output_tokens": 400}, background=True)
    hold.wait_held()
    assert http.get("/stats").json()["running"] == 1
    cancelled = client.responses.cancel(r.id)  # the abort also ends the hold
    assert (cancelled.id, cancelled.status, cancelled.output) == (r.id, "cancelled", [])
    stats = _settled(http)
    assert stats["aborted_requests"] == before["aborted_requests"] + 1
    assert stats["completed_requests"] == before["completed_requests"]
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).model_dump() == cancelled.model_dump()  # cancelling again changes nothing
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.cancel("resp_nope")


def test_a_streamed_background_response_can_be_streamed_again_from_any_event(
    client: openai.OpenAI, server: Server, http: httpx.Client, hold: Hold
) -> None:
    def stream() -> tuple[list[Any], Any]:
        with client.responses.stream(model=server.model, **ASK, background=True) as s:
            return list(s), s.get_final_response()

    events, final = _released(hold, stream)
    assert [e.sequence_number for e in events] == list(range(len(events))) and events[-1].type == "response.completed"
    # queued until the engine's first output, as OpenAI's background streams (it said in_progress at once)
    assert [(e.type, e.response.status) for e in events[:3]] == [  # type: ignore[union-attr]
        ("response.created", "queued"),
        ("response.queued", "queued"),
        ("response.in_progress", "in_progress"),
    ]
    assert final.background and final.status == "incomplete" and final.output_text
    with client.responses.stream(response_id=final.id, starting_after=3) as again:
        rest = list(again)
        replayed = again.get_final_response()
    assert [e.sequence_number for e in rest] == list(range(4, len(events)))
    assert replayed.output_text == final.output_text == client.responses.retrieve(final.id).output_text
    raw = http.get(f"/v1/responses/{final.id}", params={"stream": "true", "starting_after": len(events) - 2})
    assert [e["event"] for e in sse_events(raw.text)] == ["response.completed"]


def test_the_store_dropping_a_running_background_response_aborts_it(
    client: openai.OpenAI, server: Server, http: httpx.Client, hold: Hold
) -> None:
    before = _settled(http)
    running = client.responses.create(model=server.model, **{**ASK, "max_output_tokens": 400}, background=True)
    hold.wait_held()
    # the store keeps 3 responses (SERVER_FLAGS): three more push the running one out, least recently used
    later = [client.responses.create(model=server.model, **ASK, background=True).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    assert [_finished(client, i, hold).status for i in later] == ["incomplete"] * 3
    stats = _settled(http)
    assert stats["aborted_requests"] == before["aborted_requests"] + 1  # the dropped one, and nothing ran on
    assert stats["completed_requests"] == before["completed_requests"] + 3

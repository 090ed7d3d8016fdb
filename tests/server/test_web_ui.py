"""The web page at `/` in a real browser: headless Chromium, driven by Playwright, against a real `tokenmill serve`
with an API key. The engine holds every chat request after its first steps (HOLD_TOKEN is the chat template's first
token; tests/server/hold.py), so a reply is still streaming while a test looks at it or stops it, on a CPU of any
speed; a test whose requests need not stop midway releases every hold (`Hold.releasing`)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.helpers import (
    FORWARD_PATHS,
    REASONER_ANSWER,
    REASONER_ASK,
    REASONER_THOUGHT,
    Server,
    running,
    sse_events,
    sse_json,
    train_reasoner,
)
from tests.server.hold import Hold, hold_env

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the dev extra has it)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (scripts/setup.sh installs it with apt)")

KEY = "page-key"
HOLD_TOKEN = 1  # <|im_start|>, with which the chat template starts every prompt
# no prefix caching: a prompt seen before would start past its cached blocks, and the hold looks at its first token;
# one running sequence and one waiting: a second queued request makes the server refuse a third with 503
SERVER_FLAGS = ("--api-key", KEY, "--no-enable-prefix-caching", "--max-num-seqs", "1", "--max-waiting-requests", "1")
SERVED_MODEL_NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 24
LONG_PROMPT = "Hello world!"  # its greedy reply from the tiny model runs to MAX_TOKENS


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        # --no-sandbox: Chromium refuses to start its sandbox as root (CI's machines, containers)
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _open(browser: Any, url: str, key: str | None) -> Any:
    context = browser.new_context()
    if key is not None:  # as if the key had been given once before: the page keeps it in localStorage
        context.add_init_script(f"localStorage.setItem('tokenmill.apiKey', {json.dumps(key)})")
    page = context.new_page()
    page.set_default_timeout(30_000)
    sync_api.expect.set_options(timeout=30_000)
    page.goto(f"{url}/")
    return page


@pytest.fixture(scope="module")
def page(browser: Any, server: Server) -> Iterator[Any]:
    """The page with the key given, greedy and short replies."""
    page = _open(browser, server.url, KEY)
    sync_api.expect(page.locator("#model")).to_have_value(SERVED_MODEL_NAME)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    yield page
    page.context.close()


def _ask(page: Any, text: str) -> None:
    page.click("#new-chat")
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _finished_reply(page: Any) -> Any:
    """The conversation's last reply, once it has stopped streaming."""
    reply = page.locator("#messages > li.assistant").last
    sync_api.expect(reply).not_to_have_class("msg assistant live")
    return reply


def _stored(page: Any) -> list[dict[str, Any]]:
    """The open conversation's turns as the page stored them (localStorage)."""
    conversations = page.evaluate("JSON.parse(localStorage.getItem('tokenmill.conversations'))")
    current = page.locator("#conversations button[aria-current=true]").inner_text()
    return next(c for c in conversations if c["title"] == current)["messages"]


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)  # bounded polling


def test_the_page_asks_for_the_key_and_the_api_gives_nothing_without_it(browser: Any, server: Server) -> None:
    assert httpx.get(f"{server.url}/").status_code == 200  # the page itself is open
    assert httpx.get(f"{server.url}/ui/app.js").status_code == 200
    for path in ("/v1/models", "/stats"):
        assert httpx.get(f"{server.url}{path}").status_code == 401
    page = _open(browser, server.url, key=None)
    try:
        sync_api.expect(page.locator("#key-form")).to_be_visible()
        sync_api.expect(page.locator("#model option")).to_have_count(0)
        page.fill("#key-input", "wrong")
        page.press("#key-input", "Enter")
        sync_api.expect(page.locator("#notice")).to_contain_text("401")
        sync_api.expect(page.locator("#key-form")).to_be_visible()
        page.fill("#key-input", KEY)
        page.click("#key-form button")
        sync_api.expect(page.locator("#model")).to_have_value(SERVED_MODEL_NAME)
        sync_api.expect(page.locator("#key-form")).to_be_hidden()
        sync_api.expect(page.locator("#notice")).to_be_hidden()
    finally:
        page.context.close()


def test_a_reply_streams_in_then_shows_its_figures(page: Any, hold: Hold, http: httpx.Client) -> None:
    _ask(page, LONG_PROMPT)
    hold.wait_held()  # its first tokens are out; the rest wait for the release
    live = page.locator("#messages > li.assistant.live")
    sync_api.expect(live).to_have_count(1)
    sync_api.expect(page.locator("#stop")).to_be_enabled()
    sync_api.expect(live.locator(".figures")).to_have_count(0)  # the figures come with the last chunk
    shown = live.locator(".body").inner_text()
    hold.release()
    reply = _finished_reply(page)
    assert len(reply.locator(".body").inner_text()) > len(shown), "the reply did not grow after the first tokens"

    # the same request through the API, streamed as the page streams it: the page shows what the server says
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": LONG_PROMPT}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with hold.releasing():
        chunks = sse_json(sse_events(http.post("/v1/chat/completions", json=body).text))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert _stored(page)[-1]["content"] == text
    usage = chunks[-1]["usage"]
    figure = {key: reply.locator(f"[data-figure={key}] dd").inner_text() for key in
              ("ttft", "decode", "prompt", "cached", "output", "drafts", "path")}  # fmt: skip
    assert figure["prompt"] == str(usage["prompt_tokens"])
    assert figure["output"] == str(usage["completion_tokens"]) == str(MAX_TOKENS)
    assert figure["cached"] == "0" and figure["drafts"] == "0 / 0"  # no prefix caching, no drafting here
    assert float(figure["ttft"].removesuffix(" ms")) > 0 and float(figure["decode"].removesuffix(" tok/s")) > 0
    assert any(figure["path"].startswith(f"{name} ×") for name in FORWARD_PATHS), figure["path"]


def test_stop_aborts_the_request_on_the_server(page: Any, hold: Hold, http: httpx.Client) -> None:
    before = http.get("/stats").json()
    # the abort ends the hold, and the step after it still runs: the prompt's greedy reply must go on past that step
    # (it runs to max_tokens: the test above), or the request would end there on its own
    _ask(page, LONG_PROMPT)
    try:
        hold.wait_held()
        page.click("#stop")
        _wait_for(lambda: http.get("/stats").json()["aborted_requests"] == before["aborted_requests"] + 1,
                  "the server's abort")  # fmt: skip
    finally:
        hold.release()  # a no-op once the abort ended the hold
    stats = http.get("/stats").json()
    assert stats["completed_requests"] == before["completed_requests"] and stats["running"] == 0
    assert stats["kv_blocks_used"] == 0  # its blocks went back to the pool
    sync_api.expect(_finished_reply(page).locator(".stopped")).to_have_text("Stopped.")
    sync_api.expect(page.locator("#send")).to_be_enabled()


def test_edit_and_regenerate_ask_again(page: Any, hold: Hold) -> None:
    with hold.releasing():
        _ask(page, "First question")
        first = _finished_reply(page).locator(".body").inner_text()
        page.locator("#messages > li.assistant").last.get_by_role("button", name="Regenerate").click()
        sync_api.expect(page.locator("#messages > li.assistant")).to_have_count(1)
        assert _finished_reply(page).locator(".body").inner_text() == first  # greedy: the same reply again
        page.locator("#messages > li.user").get_by_role("button", name="Edit").click()
        page.get_by_label("Edit message").fill("Second question")
        page.get_by_role("button", name="Save and send").click()
        _finished_reply(page)
    turns = _stored(page)
    assert [t["role"] for t in turns] == ["user", "assistant"] and turns[0]["content"] == "Second question"


def test_a_bad_parameter_shows_the_servers_message_and_the_page_goes_on(page: Any, hold: Hold) -> None:
    page.fill("#temperature", "-1")
    _ask(page, "Too cold")
    error = _finished_reply(page).locator(".error")
    sync_api.expect(error).to_contain_text("400")
    sync_api.expect(error).to_contain_text("temperature")
    page.fill("#temperature", "0")
    page.fill("#schema", "{not json")
    _ask(page, "Bad schema")
    sync_api.expect(_finished_reply(page).locator(".error")).to_contain_text("not valid JSON")
    page.fill("#schema", "")
    with hold.releasing():
        _ask(page, "Warm again")
        sync_api.expect(_finished_reply(page).locator(".figures")).to_be_visible()


def _gauge(page: Any, key: str) -> Any:
    return page.locator(f"[data-gauge={key}] dd")


def test_the_engine_view_moves_under_load_and_a_full_queue_reads_as_503(
    page: Any, hold: Hold, http: httpx.Client
) -> None:
    page.click("#tab-engine")
    sync_api.expect(_gauge(page, "running")).to_have_text("0")
    completed = int(_gauge(page, "requests").inner_text().split(" / ")[0])
    done: list[int] = []

    def complete(prompt: list[int]) -> None:
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        done.append(http.post("/v1/completions", json=body).status_code)

    held = threading.Thread(target=complete, args=([HOLD_TOKEN, 30, 31],))
    queued = threading.Thread(target=complete, args=([5, 6, 7],))
    try:
        held.start()
        hold.wait_held()
        queued.start()  # --max-num-seqs 1: it waits while the held one runs
        sync_api.expect(_gauge(page, "running")).to_have_text("1")
        sync_api.expect(_gauge(page, "waiting")).to_have_text("1")
        sync_api.expect(_gauge(page, "kv")).not_to_contain_text("(0 /")
        page.click("#tab-chat")
        _ask(page, "Anyone there?")  # --max-waiting-requests 1, and one waits already
        error = _finished_reply(page).locator(".error")
        sync_api.expect(error).to_contain_text("503")
        sync_api.expect(error).to_contain_text("overloaded")
    finally:
        hold.release()
        held.join(60)
        queued.join(60)
    assert done == [200, 200]
    page.click("#tab-engine")
    sync_api.expect(_gauge(page, "requests")).to_contain_text(f"{completed + 2} /")
    sync_api.expect(_gauge(page, "running")).to_have_text("0")
    assert page.locator("#plots canvas").count() == 4
    page.click("#tab-chat")


def test_markdown_is_rendered_and_raw_html_sanitised(page: Any, hold: Hold) -> None:
    with hold.releasing():
        _ask(page, "**bold** and `code`\n\n```\nblock\n```\n\n<img src=x onerror=\"document.title='owned'\">")
        _finished_reply(page)
    turn = page.locator("#messages > li.user .body")
    sync_api.expect(turn.locator("strong")).to_have_text("bold")
    sync_api.expect(turn.locator("pre code")).to_have_text("block\n")
    assert turn.locator("img").get_attribute("onerror") is None and page.title() == "tokenmill"


def test_a_json_schema_constrains_the_reply(page: Any, hold: Hold) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    page.fill("#schema", json.dumps(schema))
    try:
        with hold.releasing():
            _ask(page, "A number, please")
            sync_api.expect(_finished_reply(page).locator(".figures")).to_be_visible()
    finally:
        page.fill("#schema", "")
    assert _stored(page)[-1]["content"].startswith('{"n": ')  # the grammar's first tokens, however it ends


def test_export_downloads_the_stored_conversations(page: Any) -> None:
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported == page.evaluate("JSON.parse(localStorage.getItem('tokenmill.conversations'))")
    assert any(turn["role"] == "assistant" for conv in exported for turn in conv["messages"])


def test_reasoning_is_folded_apart_and_a_server_gone_mid_reply_reads_as_such(
    browser: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Its own server, with a model that reasons (tests/server/helpers.py), killed while a second reply streams: the
    first reply's reasoning is folded apart from its answer; then the page says the connection broke and goes on."""
    hold = Hold(tmp_path / "hold")
    hold.folder.mkdir()
    model = train_reasoner(tokenizer_dir, tmp_path / "reasoner")
    with running(model, tmp_path, "--no-enable-prefix-caching", env=hold_env(HOLD_TOKEN, hold.folder)) as doomed:
        page = _open(browser, doomed.url, key=None)
        try:
            sync_api.expect(page.locator("#model")).not_to_have_value("")  # no key asked: the server needs none
            sync_api.expect(page.locator("#key-form")).to_be_hidden()
            page.fill("#temperature", "0")
            with hold.releasing():
                _ask(page, REASONER_ASK[0]["content"])
                reply = _finished_reply(page)
            folded = reply.locator("details.reasoning")
            assert folded.get_attribute("open") is None  # folded until opened
            assert folded.locator(".body").text_content().strip() == REASONER_THOUGHT.strip()
            assert reply.locator(":scope > .body").inner_text().strip() == REASONER_ANSWER.strip()
            with page.expect_response(lambda r: r.url.endswith("/chat/completions")):  # its headers reached the page
                _ask(page, REASONER_ASK[0]["content"])
            hold.wait_held()
            doomed.proc.kill()
            doomed.proc.wait(30)
            sync_api.expect(_finished_reply(page).locator(".error")).to_contain_text("mid-reply")
            sync_api.expect(page.locator("#send")).to_be_enabled()
        finally:
            page.context.close()

"""The README's two pictures of the web page (docs/img/web_ui_chat.png, docs/img/web_ui_engine.png), taken with
headless Chromium (Playwright) from a running server: a chat's replies with their figures, then the engine view while a
few clients stream.

    .venv/bin/tokenmill serve &   # the demo model
    .venv/bin/python scripts/web_ui_screenshots.py http://127.0.0.1:8000 docs/img
"""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

PROMPTS = ["Good morrow! Who goes there?", "What news from Verona?"]  # the second reuses the first's KV blocks
LOAD = ["ROMEO:", "JULIET:", "HAMLET:", "First Citizen:"]


def load(url: str, model: str, stop: threading.Event) -> None:
    """Clients that ask again and again until `stop`, so the engine view has something to show."""

    def client(prompt: str) -> None:
        while not stop.is_set():
            body = {"model": model, "prompt": prompt, "max_tokens": 120, "stream": False}
            httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    for prompt in LOAD:
        threading.Thread(target=client, args=(prompt,), daemon=True).start()


def main(url: str, out: Path) -> None:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(f"{url}/")
        page.fill("#max-tokens", "80")
        for i, prompt in enumerate(PROMPTS):
            page.fill("#prompt", prompt)
            page.press("#prompt", "Enter")
            page.locator("#messages li.assistant:not(.live) .figures").nth(i).wait_for(timeout=120_000)
        page.screenshot(path=out / "web_ui_chat.png")
        stop = threading.Event()
        load(url, model, stop)
        page.click("#tab-engine")
        page.wait_for_timeout(30_000)
        page.screenshot(path=out / "web_ui_engine.png")
        stop.set()
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"), Path(sys.argv[2]))

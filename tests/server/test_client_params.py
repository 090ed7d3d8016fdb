"""OpenAI parameters that clients send by default or often, through the official SDK: `logit_bias` (a large
bias forces a token), `response_format: text`, `models.retrieve`, and image content parts (a clear 400: the
model takes text only)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.helpers import Server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0)


def test_a_large_logit_bias_forces_the_token(client: openai.OpenAI, server: Server) -> None:
    for token in (17, 250):
        r = client.completions.create(model=server.model, prompt=[5, 6, 7], max_tokens=6, temperature=1.0,
                                      logit_bias={str(token): 100}, seed=1)  # fmt: skip
        forced = httpx.post(f"{server.url}/detokenize", json={"tokens": [token] * 6}, timeout=30).json()["prompt"]
        assert r.choices[0].text == forced
    only = {str(t): -100 for t in range(384) if t != 33}  # every other token pushed down: 33 is left
    r = client.completions.create(model=server.model, prompt=[5, 6, 7], max_tokens=4, temperature=1.0,
                                  logit_bias=only, seed=2)  # fmt: skip
    assert r.choices[0].text == httpx.post(f"{server.url}/detokenize", json={"tokens": [33] * 4}).json()["prompt"]
    for bad in ({"x": 1}, {"5": 101}, {"99999": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=server.model, prompt="x", max_tokens=1, logit_bias=bad)


def test_response_format_text_and_models_retrieve(client: openai.OpenAI, server: Server) -> None:
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, response_format={"type": "text"})  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")
    card = client.models.retrieve(server.model)
    assert card.id == server.model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_image_parts_get_a_clear_400(client: openai.OpenAI, server: Server) -> None:
    content: Any = [{"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="takes text only; content parts of type 'image_url'"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                       max_tokens=3)  # fmt: skip
    for field in ("best_of", "suffix", "store"):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model=server.model, prompt="x", max_tokens=1, extra_body={field: 1})

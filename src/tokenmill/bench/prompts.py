"""Prompts of a given token length for `tokenmill bench serve`: random common words, fitted to the length by a
local tokenizer, the server's /tokenize, or (with neither) counted in words."""

from __future__ import annotations

import random
from typing import Any

import httpx

_WORD_TEXT = (
    "time person year way day thing man world life hand part child eye woman place work week case point number "
    "group problem fact water room mother area money story month lot right study book word business issue side "
    "kind head house service friend father power hour game line end member law car city community name team "
    "minute idea kid body information back parent face others level office door health art war history party "
    "result change morning reason research girl guy moment air teacher force education river stone light"
)
WORDS = tuple(_WORD_TEXT.split())


class TokenCounter:
    """Token counts for prompts and outputs: a local HF tokenizer, else the server's /tokenize, else none."""

    def __init__(self, tokenizer_dir: str | None, client: httpx.Client, model: str) -> None:
        self.client, self.model, self.local = client, model, None
        self.source, self.can_decode = "words", False
        if tokenizer_dir:
            from tokenmill.tokenizer import Tokenizer

            self.local, self.source, self.can_decode = Tokenizer(tokenizer_dir), "tokenizer", True
            return
        try:
            if self._post("/tokenize", {"model": model, "prompt": "hello world", "add_special_tokens": False}):
                self.source = "server"
                self.can_decode = self.decode(self.encode("hello world")) is not None
        except Exception:  # any server: no /tokenize means word-based prompts
            self.source = "words"

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        r = self.client.post(path, json=body)
        return r.json() if r.status_code == 200 else None

    def encode(self, text: str) -> list[int]:
        if self.local is not None:
            return self.local.encode(text, add_special_tokens=False)
        out = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return list(out["tokens"]) if out else []

    def decode(self, ids: list[int]) -> str | None:
        if self.local is not None:
            return self.local.decode(ids)
        try:
            out = self._post("/detokenize", {"model": self.model, "tokens": ids})
        except Exception:
            return None
        return str(out["prompt"]) if out and "prompt" in out else None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def fit_text(counter: TokenCounter, rng: random.Random, target: int) -> tuple[str, int]:
    """Deterministic random-word text of exactly `target` tokens where a tokenizer allows (else `target` words)."""
    text = _words(rng, target)
    if counter.source == "words":
        return text, target
    best: tuple[str, int] = (text, -1)
    for _ in range(8):
        ids = counter.encode(text)
        if abs(len(ids) - target) < abs(best[1] - target):
            best = (text, len(ids))
        if len(ids) == target:
            break
        if len(ids) > target:
            cut = counter.decode(ids[:target]) if counter.can_decode else None
            text = cut if cut is not None else " ".join(text.split()[: max(1, len(text.split()) - (len(ids) - target))])
        else:
            text += " " + _words(rng, target - len(ids))
    return best

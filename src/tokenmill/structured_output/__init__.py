"""Structured output: grammars that constrain what a request may sample (JSON schema, regex, choice, grammar).

The engine core owns one `StructuredOutputManager`. Per step it fills a token bitmask row for each constrained
sequence that samples (`bitmask`); the runner's sampler masks those rows' logits (`sampling.apply_bitmask`), so
constrained and free requests share one batched step. After the step the core feeds each sampled token back
(`accept`); a grammar that has reached its end (`finished`) ends the request with "stop". EOS is allowed only
where the grammar may end.

Grammars compile through a `GrammarBackend` (one today, llguidance: guidance.py), off the engine loop thread
(the server compiles before it queues the request) and are cached by their text, so a schema sent again costs a
dictionary lookup. Each request gets its own matcher from the compiled grammar. A matcher follows the tokens a
request has generated, not its KV cache, so preemption (recompute) leaves it as it is.

Speculative decoding does not draft for constrained requests: they decode one token per step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol

import torch

from tokenmill.sampling_params import StructuredOutputsParams

CACHE_SIZE = 128  # compiled grammars kept (least recently used goes first)


class Matcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...  # [R, W] int32: bit t set = t allowed

    def accept(self, token: int) -> bool: ...  # False: the grammar does not allow `token` here

    def finished(self) -> bool: ...  # the grammar has ended: nothing more may follow


class Grammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    def compile(self, kind: str, text: str) -> Grammar: ...  # ValueError naming what is wrong


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    def __init__(self, rust_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """`rust_tokenizer`: the model's Rust `tokenizers.Tokenizer` (`Tokenizer.rust`; None for a slow tokenizer,
        which grammars cannot use), or a function giving it, called at the first compile."""
        self._rust, self.vocab_size, self._eos = rust_tokenizer, vocab_size, sorted(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()  # compile runs on callers' threads
        self._matchers: dict[str, Matcher] = {}  # sequence id -> its matcher (engine thread only)

    # -- any thread -------------------------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The compiled grammar for `params` (cached by its text). ValueError with the backend's message."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            backend = self._backend = self._backend or self._make_backend()
        grammar = backend.compile(*key)  # outside the lock: another request's compile need not wait
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _make_backend(self) -> GrammarBackend:
        from tokenmill.structured_output.guidance import GuidanceBackend

        rust = self._rust() if callable(self._rust) else self._rust
        return GuidanceBackend(rust, self.vocab_size, self._eos)

    # -- the engine thread ------------------------------------------------------------------------------------
    def add(self, seq_id: str, grammar: Grammar) -> None:
        self._matchers[seq_id] = grammar.matcher()

    def remove(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def bitmask(self, seq_ids: list[str], forced: dict[str, int] | None = None) -> torch.Tensor:
        """[len(seq_ids), W] int32: row i the tokens sequence i may sample next: its grammar's, or the one token
        `forced` names for it (a spent thinking budget's end of thinking: engine/thinking.py)."""
        mask = torch.zeros(len(seq_ids), bitmask_words(self.vocab_size), dtype=torch.int32)
        for row, seq_id in enumerate(seq_ids):
            token = (forced or {}).get(seq_id)
            if token is not None:
                mask[row, token // 32] = _bit(token % 32)
            else:
                self._matchers[seq_id].fill_bitmask(mask, row)
        return mask

    def accept(self, seq_id: str, token: int) -> bool:
        return self._matchers[seq_id].accept(token)

    def finished(self, seq_id: str) -> bool:
        return self._matchers[seq_id].finished()

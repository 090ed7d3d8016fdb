"""The llguidance grammar backend (MIT; an abi3 wheel with no dependencies of its own).

Chosen over xgrammar because its CPU wheel pulls nothing else in (xgrammar brings triton and a TVM FFI
package into a CPU install), and it fills a token mask in a fraction of a millisecond on CPU.
llguidance parses JSON schemas, regexes, Lark grammars, and converts GBNF; compiling is bounded by its parser
limits (lexer fuel, grammar size), so a hostile grammar fails with an error instead of running on.
"""

from __future__ import annotations

import json
from copy import copy
from typing import Any

import llguidance
import llguidance.torch
import numpy as np
import torch

# JSON as OpenAI and vLLM produce it: compact separators with one space, no free whitespace runs
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token)) and not self._m.is_error()

    def finished(self) -> bool:
        return bool(self._m.is_stopped())


class GuidanceGrammar:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._pristine = matcher  # never advanced: each request gets a copy

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._pristine.deep_copy())


class GuidanceBackend:
    def __init__(self, rust_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        """llguidance's token table from the Rust tokenizer's JSON, as `llguidance.hf.from_tokenizer` builds it
        from a transformers tokenizer's backend (without importing transformers)."""
        if rust_tokenizer is None:
            raise ValueError("structured output needs a tokenizer with a tokenizer.json (a fast tokenizer)")
        backend = copy(rust_tokenizer)  # padding and truncation off on a copy, as llguidance.hf does
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids

    def compile(self, kind: str, text: str) -> GuidanceGrammar:
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.loads(text),
                    defaults=JSON_OPTIONS,  # type: ignore[arg-type]
                )
            else:
                grammar = llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {_NAMES[kind]}: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {_NAMES[kind]}: {matcher.get_error()}")
        if self._matches_nothing(matcher):
            raise ValueError(f"invalid {_NAMES[kind]}: no output matches it")
        return GuidanceGrammar(matcher)

    def _matches_nothing(self, matcher: llguidance.LLMatcher) -> bool:
        """The grammar's language is empty (the regex [a&&b]): before any token it is not accepting, and it allows
        no token but EOS, which it would then refuse (the request would end in "error")."""
        if matcher.is_accepting():
            return False
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)  # [1, words] int32
        llguidance.torch.fill_next_token_bitmask(matcher.deep_copy(), bitmask, 0)
        allowed = np.unpackbits(bitmask[0].view(torch.uint8).numpy(), bitorder="little")[: self.vocab_size]
        ids = np.flatnonzero(allowed)  # most grammars allow many tokens: the count settles it before any set
        return len(ids) <= len(self.eos_token_ids) and set(ids.tolist()) <= set(self.eos_token_ids)


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}

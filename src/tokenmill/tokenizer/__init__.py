"""The tokenizer, chat templates, and incremental detokenization that is safe for multi-byte UTF-8.

A tokenizer folder loads without transformers (the lean tokenizer: lean.py) once its first load has seen
transformers' tokenizer of it behave alike (verdict.py); else through transformers, as does a folder without a
tokenizer.json. A GGUF's tokenizer is built by transformers once and kept as such a folder (gguf.py).

Must not import torch: the server side uses it too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.tokenizer.backend import TokenizerBackend

log = logging.getLogger("tokenmill.tokenizer")

# How many earlier tokens to re-decode with each new one, so word boundaries and spaces come out right.
_CONTEXT_TOKENS = 5


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (byte-level BPE pieces are written in it) -> the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_OF = _byte_alphabet()


class Tokenizer:
    """The tokenizer of a checkpoint folder, or the one stored in a GGUF file's metadata."""

    template_problem: str | None = None  # why the chat template does not parse, found at load (None: it does)

    def __init__(self, source: Path | str, model_type: str | None = None, gguf_metadata: Any = None) -> None:
        """`model_type`: a GGUF's (its config's `model_type`), which names the tokenizer class at once; without it
        transformers reads the whole file's metadata again to learn it (seconds for a 150k vocabulary).
        `gguf_metadata`: a GGUF's metadata, key -> value (GGUFCheckpoint.metadata), from which a byte-level BPE
        tokenizer is built without transformers (tokenizer/gguf_bpe.py)."""
        from tokenmill.tokenizer import gguf, verdict

        source = Path(source)
        try:
            if source.suffix.lower() == ".gguf":
                self.backend: TokenizerBackend = gguf.gguf_tokenizer(source, model_type, gguf_metadata)
            else:
                self.backend = verdict.load(source)
        except Exception as e:
            said = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:400]  # (one line, whole:
            raise ModelLoadError(f"cannot load the tokenizer from {source}: {said}") from None  # a validation error's
            # first line named the field and left out what was wrong with it)
        if self.backend.chat_template:
            from tokenmill.tokenizer.chat_template import syntax_problem

            self.template_problem = syntax_problem(self.backend.chat_template)
            if self.template_problem is not None:  # (plain prompts still run: a warning, not a failed load)
                log.warning("%s: its %s; chat requests will be refused, plain completions run", source,
                            self.template_problem)  # fmt: skip

    @property
    def rust(self) -> Any:
        """The Rust `tokenizers.Tokenizer` it runs on (grammars build their token tables from it); None for a slow,
        pure-Python tokenizer."""
        return self.backend.rust

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.backend.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self.backend.chat_template)

    @property
    def chat_template_text(self) -> str:
        """The chat template's source ("" without one; several named templates joined)."""
        template = self.backend.chat_template or ""
        return "\n".join(template.values()) if isinstance(template, dict) else str(template)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included."""
        return self.backend.get_vocab()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens)

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one input (a cross-encoder's query and document): joined by the tokenizer's pair template,
        as transformers' `tokenizer(text, pair)`; without a Rust tokenizer, the first's tokens (special tokens
        added) then the second's."""
        rust = self.backend.rust
        if rust is not None:
            return list(rust.encode(text, pair, add_special_tokens=True).ids)
        return self.encode(text) + self.encode(pair, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, part of a character included (its decoded text would end in U+FFFD
        there): a byte-level BPE's piece through GPT-2's byte alphabet, a SentencePiece byte piece (<0xE3>) as
        that byte and another piece with its word-start mark as a space; else (special tokens) its text."""
        piece = self.backend.id_to_token(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            if not self._byte_level and token_id not in self._special_ids:
                return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    @cached_property
    def _special_ids(self) -> frozenset[int | None]:
        return frozenset(self.backend.all_special_ids)

    @cached_property
    def _byte_level(self) -> bool:
        """The pieces are written in GPT-2's byte alphabet (GPT-2, Llama 3, Qwen and most BPEs since)."""
        rust = self.backend.rust
        return rust is not None and "ByteLevel" in type(rust.decoder).__name__ + str(rust.decoder)

    def decode_stream(self, context: list[int], skip_special_tokens: bool) -> tuple[Any, Any] | None:
        """(the Rust tokenizer, a `tokenizers` DecodeStream primed with the token ids `context`), or None where
        the tokenizer has no Rust backend or transformers changes its decoded text afterwards (tokenization-space
        cleanup), which the stream would not."""
        from tokenizers.decoders import DecodeStream

        rust = self.backend.rust
        if rust is None or self.backend.clean_up_tokenization_spaces:
            return None
        return rust, DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of a conversation rendered through the tokenizer's own chat template."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        if self.template_problem is not None:  # the model's files are at fault, not the messages
            raise ValueError(f"this model's {self.template_problem}: fix its chat template; plain prompts still run")
        from jinja2 import TemplateError

        try:
            rendered = self.backend.render_chat(messages, add_generation_prompt, kwargs)
        except TemplateError as e:  # the template refused the conversation (raise_exception) or failed on it
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        # The template already holds any BOS it wants; do not add another.
        return self.encode(rendered, add_special_tokens=False)


class DeferredTokenizer(Tokenizer):
    """A tokenizer built on first use, whose EOS id is known before: the engine's own process, whose server holds
    the tokenizer and sends the id (engine/process_engine.py). Only a grammar or a score model's yes/no tokens build
    it there; detokenizing is the server's."""

    def __init__(self, source: Path | str, model_type: str | None, gguf_metadata: Any,
                 eos_token_id: Callable[[], int | None]) -> None:  # fmt: skip
        self._args = (source, model_type, gguf_metadata)
        self._eos = eos_token_id

    @cached_property
    def backend(self) -> TokenizerBackend:  # type: ignore[override]
        return Tokenizer(*self._args).backend

    @property
    def eos_token_id(self) -> int | None:
        return self._eos()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (a few context tokens + the new ones) and emits only the text past the context;
    while the window ends in an incomplete UTF-8 sequence (U+FFFD), it waits for more tokens.

    Where the tokenizer has a Rust backend, its `DecodeStream` runs the same windows in one call per token (two
    decodes through transformers took ~5 µs a token warm, and ~70 µs of a one-row decode step right after the
    weights had streamed through the caches; the stream ~0.7 µs warm). Its windows move as ours do, so
    `prefix_offset` and `read_offset` follow it, and `flush` and a stream that refuses a window (its prefix text
    changed: `InvalidPrefix`) go on with ours.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stream = tokenizer.decode_stream(self.token_ids, skip_special_tokens)  # (Rust tokenizer, stream)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        if self.stream is None:
            return self._advance(final=False)
        rust, stream = self.stream
        try:
            delta = stream.step(rust, token_id)
        except Exception:  # the windows below decode this token and every later one
            self.stream = None
            return self._advance(final=False)
        if delta is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return str(delta)

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is held back, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

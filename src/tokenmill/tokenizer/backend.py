"""What `Tokenizer` needs of a tokenizer: the lean one (lean.py) and transformers' (transformers_backend.py) both
offer it."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Protocol


class TokenizerBackend(Protocol):
    @property
    def name(self) -> str: ...  # "lean" or "transformers"

    @property
    def rust(self) -> Any: ...  # the Rust tokenizers.Tokenizer it runs on; None for a slow (pure-Python) tokenizer

    @property
    def vocab_size(self) -> int: ...  # added tokens included

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def chat_template(self) -> str | dict[str, str] | None: ...

    @property
    def special_tokens_map(self) -> dict[str, str]: ...  # bos_token etc.: what the chat template sees

    @property
    def all_special_ids(self) -> list[int | None]: ...

    @property
    def clean_up_tokenization_spaces(self) -> bool: ...  # as configured (transformers then skips it for BPE)

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def get_vocab(self) -> dict[str, int]: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...

    def render_chat(self, messages: list[Any], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str: ...


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")


def write_atomic(path: Path, text: str) -> bool:
    """Write aside and rename, so a concurrent reader sees the old file or the whole new one. False where the
    folder cannot be written (a read-only cache: no cache, not an error)."""
    staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)
        return False


def quick_json(serialized: str) -> str:
    """tokenizer.json as `tokenizers` writes it, in the form it reads fastest: the merges as "a b" strings (its
    older form, and the GGUF's own) in place of [a, b] pairs, and non-ASCII text as is. Both forms read to the same
    tokenizer; the 151k merges of Qwen2's vocabulary load in 227 ms against 305 (Xeon, 2 vCPUs), and this is a
    start's second-largest step after `import torch`. Pairs stay where a part holds a space (a string could not say
    where it splits)."""
    tok = json.loads(serialized)
    string_merges(tok)
    return json.dumps(tok, ensure_ascii=False)


def string_merges(tok: dict[str, Any]) -> bool:
    """A parsed tokenizer.json's [a, b] merge pairs made "a b" strings, in place (quick_json); False where it holds
    none, or one whose part holds a space."""
    merges = tok.get("model", {}).get("merges")
    if not merges or not all(isinstance(m, list) and " " not in m[0] + m[1] for m in merges):
        return False
    tok["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return True

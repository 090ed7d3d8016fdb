"""The tokenizer stored in a GGUF file's metadata, built once and kept as a tokenizer folder: by `gguf_bpe` from the
metadata where it builds the file's kind (byte-level BPE: Qwen2/Qwen3, Llama 3, GPT-2), else by transformers."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.progress import progress
from tokenmill.tokenizer import gguf_bpe, verdict
from tokenmill.tokenizer.backend import TokenizerBackend, cache_root
from tokenmill.tokenizer.lean import LeanTokenizer, read_config
from tokenmill.tokenizer.transformers_backend import TransformersTokenizer

_PROBE = "Hello, world! To be, or not to be: 12 ünïcödé 日本語 🙂\n\tdone."


def gguf_tokenizer(
    path: Path, model_type: str | None = None, meta: gguf_bpe.Metadata | None = None
) -> TokenizerBackend:
    """A byte-level BPE file's tokenizer is built from its metadata (`meta`, read by the weights layer) by
    `gguf_bpe` (half a second for a 150k vocabulary, no transformers import) and kept as a folder, which later
    starts load as the lean tokenizer.

    Any other kind: transformers builds a fast tokenizer (with the chat template and BOS/EOS) from the GGUF's
    metadata. That takes seconds for a 150k vocabulary, so the result is kept, keyed by the file's path, size and
    mtime, in `$TOKENMILL_CACHE_DIR` (default ~/.cache/tokenmill)/gguf-tokenizers, once a reload of it is checked to
    tokenize as the original (an architecture's tokenizer class can save what it cannot reload: Gemma's class over
    a byte-level BPE). The kept folder then loads as any tokenizer folder does (`verdict`): from the second start
    on, without transformers where the lean tokenizer matched it. With `model_type`, AutoTokenizer takes the class
    from it (`tokenizer_type`) instead of building the model's config from the file first, which reads every
    metadata array with the gguf package's reader (on a Qwen2 file, 11.0 s instead of ~2 s: docs/benchmarks.md)."""
    cached = kept_folder(path)
    key = cached.name
    if (cached / "tokenizer_config.json").is_file() and (kept := _load_kept(cached)) is not None:
        return kept
    built = gguf_bpe.build(meta) if meta is not None else None
    if built is not None:
        return LeanTokenizer(_keep(built, cached))
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    known = model_type is not None and TOKENIZER_MAPPING_NAMES.get(model_type) is not None
    with progress(f"building the tokenizer of {path.name} (once; cached)"):
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                            **({"tokenizer_type": model_type} if known else {}))  # fmt: skip
    staging = cached.with_name(f"{key}.{os.getpid()}.tmp")
    try:  # written aside and renamed, so a concurrent reader never sees half a cache entry
        tok.save_pretrained(str(staging))
        reloaded = AutoTokenizer.from_pretrained(str(staging))
        if _same_tokens(tok, reloaded):
            staging.rename(cached)
            verdict.judge(cached, reloaded, verdict.entry_of(cached))  # so the next start may skip transformers
            # NOTE: every later start reads the kept folder, whose tokenizer class may add to what the GGUF gave
            # (Qwen2's: NFC); this start tokenizes as they will.
            tok = reloaded
    except OSError:  # a read-only home, or another process was first: no cache from us, same tokenizer
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TransformersTokenizer(tok)


def kept_folder(path: Path) -> Path:
    """Where the tokenizer built of this GGUF is kept (keyed by the file's path, size and mtime)."""
    stat = path.resolve().stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|bpe {gguf_bpe.REVISION}"
    return cache_root() / "gguf-tokenizers" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def _load_kept(folder: Path) -> TokenizerBackend | None:
    """The kept folder's tokenizer; None where a folder of ours is damaged (removed, to be built again)."""
    try:
        ours = str(read_config(folder).get("built_by", "")).startswith("tokenmill gguf_bpe")
        return LeanTokenizer(folder) if ours else verdict.load(folder)
    except Exception:  # a damaged or half-removed entry: json's, the tokenizers library's or the OS's error
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _keep(built: gguf_bpe.BuiltTokenizer, cached: Path) -> Path:
    """The folder of `built`: the cache entry, or (a cache that cannot be written) a temporary folder."""
    staging = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:
        _write(built, staging)
        staging.rename(cached)
        return cached
    except OSError:  # a read-only cache, or another process was first
        shutil.rmtree(staging, ignore_errors=True)
    if (cached / "tokenizer_config.json").is_file():
        return cached
    folder = Path(tempfile.mkdtemp(prefix="tokenmill-tokenizer-"))
    atexit.register(shutil.rmtree, folder, True)
    _write(built, folder)
    return folder


def _write(built: gguf_bpe.BuiltTokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(built.tokenizer_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(built.config, indent=1), encoding="utf-8")
    if built.chat_template is not None:
        (folder / "chat_template.jinja").write_text(built.chat_template, encoding="utf-8")


def _same_tokens(a: Any, b: Any) -> bool:
    try:
        return bool(a.encode(_PROBE) == b.encode(_PROBE) and a.chat_template == b.chat_template)
    except Exception:  # the tokenizers library raises a plain Exception for a token missing from the vocabulary
        return False

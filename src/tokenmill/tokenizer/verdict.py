"""Which tokenizer a folder loads with: the lean one, which needs no transformers import, where transformers'
tokenizer of the folder was seen to behave alike; else transformers'.

The first load of a folder builds both, compares them (`probes.differences`) and records the verdict in
`$TOKENMILL_CACHE_DIR` (default ~/.cache/tokenmill)/tokenizer-verdicts/<key>.json; the key is made of the folder's
tokenizer files (path, size, mtime), the transformers and tokenizers versions and LEAN_REVISION. That load uses
transformers' tokenizer, built anyway. Later loads read the verdict: "same" loads the lean tokenizer, "differs"
transformers' (logged at INFO with the reason).

A tokenizer class of transformers may rebuild the Rust tokenizer on load (Qwen2's adds the NFC normalizer that a
tokenizer.json converted from a GGUF lacks): the rebuilt one is then kept beside the verdict (<key>.tokenizer.json)
and the lean tokenizer loads it instead of the folder's. A cache that cannot be written, or a verdict that cannot be
read, means transformers, as without a cache."""

from __future__ import annotations

import hashlib
import json
import logging
from copy import copy
from pathlib import Path
from typing import Any

from tokenmill.tokenizer import probes
from tokenmill.tokenizer.backend import TokenizerBackend, cache_root, string_merges, write_atomic
from tokenmill.tokenizer.lean import LeanTokenizer
from tokenmill.tokenizer.transformers_backend import TransformersTokenizer

log = logging.getLogger("tokenmill.tokenizer")

LEAN_REVISION = 2  # raise it when the lean tokenizer or the probes change: earlier verdicts then no longer count
# the files transformers reads from a tokenizer folder (config.json: the tokenizer class where the config names none)
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja", "config.json")  # fmt: skip


def load(folder: Path) -> TokenizerBackend:
    """The tokenizer of `folder` (its tokenizer.json and configs)."""
    if not (folder / "tokenizer.json").is_file():  # a slow (pure-Python) tokenizer, or a Hub name
        return TransformersTokenizer.load(folder)
    entry = entry_of(folder)
    recorded = _read(entry)
    if recorded is not None and recorded.get("verdict") == "same":
        kept = recorded.get("tokenizer_json")
        try:
            lean = LeanTokenizer(folder, entry.with_name(kept) if isinstance(kept, str) else None)
            log.info("tokenizer of %s: the lean one (it matched transformers' on probes)", folder)
            return lean
        except Exception as e:  # a damaged cache entry: judge again
            log.info("tokenizer of %s: the lean one failed to load (%s); comparing again", folder, e)
    elif recorded is not None:
        log.info("tokenizer of %s: transformers' (the lean one differs: %s)", folder, recorded.get("reason"))
        return TransformersTokenizer.load(folder)
    chosen = TransformersTokenizer.load(folder)
    judge(folder, chosen.hf, entry)
    return chosen


def entry_of(folder: Path) -> Path:
    """Where the verdict on `folder`, as its files are now, is kept."""
    return cache_root() / "tokenizer-verdicts" / f"{key(folder)}.json"


def key(folder: Path) -> str:
    from importlib.metadata import PackageNotFoundError, version

    import tokenizers

    try:
        transformers_version = version("transformers")
    except PackageNotFoundError:
        transformers_version = "none"
    folder = folder.resolve()
    parts = [str(folder), f"lean {LEAN_REVISION}", f"transformers {transformers_version}",
             f"tokenizers {tokenizers.__version__}"]  # fmt: skip
    extra = folder / "additional_chat_templates"
    for path in [*(folder / name for name in FILES), *sorted(extra.glob("*.jinja") if extra.is_dir() else [])]:
        try:
            stat = path.stat()
            parts.append(f"{path.relative_to(folder)} {stat.st_size} {stat.st_mtime_ns}")
        except OSError:
            parts.append(f"{path.relative_to(folder)} absent")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def judge(folder: Path, hf: Any, entry: Path) -> None:
    """Compare the lean tokenizer of `folder` with transformers' (`hf`) and record the verdict at `entry`."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # nothing could be recorded: spare the comparison
    kept = None
    try:
        rebuilt = _rust_json(hf)
        if rebuilt is not None and rebuilt != _rust_json_of_file(folder / "tokenizer.json"):
            kept = entry.with_name(f"{entry.stem}.tokenizer.json")
            if not write_atomic(kept, rebuilt):
                return
        kept = _quick_copy(kept or folder / "tokenizer.json", entry) or kept
        reason = probes.differences(hf, LeanTokenizer(folder, kept))
    except Exception as e:  # the lean tokenizer cannot read this folder
        reason = f"the lean tokenizer failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if reason is not None and kept is not None:  # a verdict of "differs" loads no lean tokenizer
        kept.unlink(missing_ok=True)
        kept = None
    record = {"verdict": "same" if reason is None else "differs", "reason": reason, "folder": str(folder),
              "tokenizer_json": kept.name if kept is not None else None}  # fmt: skip
    if write_atomic(entry, json.dumps(record, indent=1)):
        log.info("tokenizer of %s compared with the lean one: %s (recorded for the next load)", folder,
                 "same" if reason is None else f"differs, {reason}")  # fmt: skip


def _quick_copy(source: Path, entry: Path) -> Path | None:
    """`source` in the form `tokenizers` reads fastest (backend.string_merges: its merges as "a b" strings, ~25% less
    of a start for a 150k vocabulary), kept beside the verdict, where that form differs from the file's and reads
    back to the same tokenizer; None otherwise (the file is read as it is)."""
    from tokenizers import Tokenizer as RustTokenizer

    tok = json.loads(source.read_text(encoding="utf-8"))
    if not string_merges(tok):
        return None  # strings already, or pairs that must stay pairs
    quick = json.dumps(tok, ensure_ascii=False)
    if RustTokenizer.from_str(quick).to_str() != RustTokenizer.from_file(str(source)).to_str():
        return None
    kept = entry.with_name(f"{entry.stem}.tokenizer.json")
    return kept if write_atomic(kept, quick) else None


def _read(entry: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, unreadable, or damaged: as if none
        return None
    return record if isinstance(record, dict) and record.get("verdict") in ("same", "differs") else None


def _rust_json(hf: Any) -> str | None:
    """transformers' Rust tokenizer as JSON, without the padding and truncation it only sets per call."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())


def _rust_json_of_file(path: Path) -> str:
    from tokenizers import Tokenizer as RustTokenizer

    rust = RustTokenizer.from_file(str(path))
    rust.no_padding()
    rust.no_truncation()
    return str(rust.to_str())

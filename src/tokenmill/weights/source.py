"""Turn a model reference (a local folder or a Hugging Face hub id) into a local checkpoint folder."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.errors import ModelLoadError

# What a checkpoint needs; never the .bin / .pt / .gguf duplicates some repos also carry.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


def _looks_like_path(ref: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else is meant as a folder."""
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or (os.sep != "/" and os.sep in ref)


def resolve_model(ref: str, revision: str | None = None) -> Path:
    """A local folder holding config.json, downloading from the hub when `ref` is a hub id."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {str(path)!r} has no config.json; is it a Hugging Face checkpoint?")
        return path
    if path.exists():
        raise ModelLoadError(f"model {ref!r} is a file; pass the checkpoint folder that holds config.json")
    if _looks_like_path(ref):
        raise ModelLoadError(f"model folder {ref!r} does not exist")
    return _download(ref, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"cannot download {repo_id!r} from the Hugging Face hub: the hub is unreachable (offline?) and the "
            "model is not in the local cache; pass a local checkpoint folder instead"
        ) from None
    except HFValidationError:
        raise ModelLoadError(
            f"model {repo_id!r} is neither an existing folder nor a valid Hugging Face hub id (owner/name)"
        ) from None
    except HfHubHTTPError as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"cannot download {repo_id!r} from the Hugging Face hub: {first_line}") from None

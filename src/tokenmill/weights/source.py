"""Turn a model reference into a local checkpoint: a folder (local, or a Hugging Face hub id) or a .gguf file
(local, or `owner/name/file.gguf` on the hub)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tokenmill.errors import ModelLoadError

# What a checkpoint needs; never the .bin / .pt / .gguf duplicates some repos also carry.
DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"  # the built-in model
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


def default_model_ref() -> str:
    """The built-in demo model's folder: what `tokenmill serve` with no MODEL serves."""
    if not (DEMO_MODEL / "config.json").is_file():
        raise ModelLoadError("no model given and the built-in demo model is not installed; pass a model folder")
    return str(DEMO_MODEL)


def _looks_like_path(ref: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else is meant as a folder."""
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or (os.sep != "/" and os.sep in ref)


def resolve_model(ref: str, revision: str | None = None) -> Path:
    """A local folder holding config.json or a local .gguf file, downloading from the hub when `ref` names one
    there."""
    if ref in ("tokenmill-demo", "demo"):  # the built-in model, by the name the server gives it
        return Path(__file__).resolve().parent.parent / "assets" / "demo"
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {str(path)!r} has no config.json; is it a Hugging Face checkpoint?")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.exists():
        raise ModelLoadError(f"model {ref!r} is a file; pass a checkpoint folder that holds config.json, or a .gguf")
    if ref.endswith(".gguf") and ref.count("/") == 2 and not ref.startswith((".", "/", "~")):
        return _download_file(ref, revision)  # owner/name/file.gguf: one file of a hub repo
    if _looks_like_path(ref):
        raise ModelLoadError(f"model {'file' if ref.endswith('.gguf') else 'folder'} {ref!r} does not exist")
    return _download(ref, revision)


def _download_file(ref: str, revision: str | None) -> Path:
    from huggingface_hub import hf_hub_download

    repo_id, filename = ref.rsplit("/", 1)
    return _from_hub(repo_id, lambda: hf_hub_download(repo_id, filename, revision=revision))


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    return _from_hub(repo_id, lambda: snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))


def _from_hub(repo_id: str, fetch: Callable[[], str]) -> Path:
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(fetch())
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

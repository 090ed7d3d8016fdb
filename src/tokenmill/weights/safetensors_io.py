"""Stream `(name, tensor)` pairs from a checkpoint's safetensors files (single or sharded), memory-mapped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the shard index when there is one."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"weight file {f} is listed in {INDEX_FILE} but does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    for f in files:  # (a FIFO or a device under the name blocked the load forever)
        if not f.is_file():
            raise ModelLoadError(f"weight file {f} is not a regular file (a pipe, device or folder); tokenmill maps "
                                 "safetensors files")  # fmt: skip
    if files:
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ModelLoadError(
            f"{folder} holds only PyTorch pickle weights (.bin/.pt); tokenmill loads safetensors. Convert with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"no weight file (*.safetensors) found in {folder}")


def count_tensors(folder: Path) -> int | None:
    """How many tensors the checkpoint holds (for progress), or None when a file cannot say."""
    try:
        total = 0
        for path in weight_files(folder):
            with safe_open(str(path), framework="pt") as f:
                total += len(list(f.keys()))
        return total
    except Exception:  # iter_tensors reports a bad file properly
        return None


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (tensor name, tensor, file) for every tensor in the checkpoint. Tensors are mmap-backed."""
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name), path
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises several types for truncated / garbage files
            raise ModelLoadError(f"weight file {path} is corrupt or not a safetensors file: {e}") from None


def sample(folder: Path, edge: int = 4096) -> bytes:
    """A fingerprint of the checkpoint's weights that reads a few pages, not the files (weights/packed_cache.py keys
    a folder's packed weights by it): each file's name, size, mtime and inode, its header, and the first and last
    `edge` bytes of every tensor. Empty where a file cannot be read (then nothing is cached; loading says why)."""
    parts: list[bytes] = []
    try:
        for path in weight_files(folder):
            st = path.stat()
            parts.append(f"{path.name}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|".encode())
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = f.read(length) if 0 < length <= st.st_size - 8 else b""
                parts.append(header)
                entries = json.loads(header) if header else {}
                for name, entry in entries.items():
                    if name == "__metadata__":
                        continue
                    begin, end = (8 + length + o for o in entry["data_offsets"])
                    f.seek(begin)
                    parts.append(f.read(min(edge, end - begin)))
                    f.seek(max(begin, end - edge))
                    parts.append(f.read(min(edge, end - begin)))
    except (OSError, ValueError, KeyError, TypeError, ModelLoadError):
        return b""
    return b"".join(parts)

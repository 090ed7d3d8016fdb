"""A GGUF's or a safetensors folder's weights as the kernels read them, kept between starts.

The kernels read a weight in their own panels (kernels/panels.py), not in the file's ggml blocks or dense rows, so
a first load repacks every linear (seconds for a 1.5B model on 2 cores; quantizing a folder with --quantization,
more) and copies it into anonymous memory. Here the packed panels are written once to `$TOKENMILL_CACHE_DIR`
(default ~/.cache/tokenmill)/packed/, and a later start maps that file in place instead: no repack, no copy, and
the pages are the page cache's, shared by every process that serves the same file (as llama.cpp maps its GGUF). A
folder's linears then never read the folder's pages at all (weights/loader.py: not even to gather q|k|v), so a
0.5B bf16 folder serves in the packed copy alone.

- One file per GGUF or folder, keyed by its identity (resolved path, size, mtime, inode, and a sample of its bytes:
  GGUFReader.sample, safetensors_io.sample, which adds each weight file's own) and the compiled kernels' identity
  (their source hash, flags and ISA variant, which fix the panel layout, not the folder they lie in: two installs
  of the same sources share the entry, kernels/build.py's layout_key). A changed file or a rebuilt kernel gets a new
  key, and writing it removes the older entries of the same path. A folder's entry holds the formats it was packed
  in (a dtype or --quantization); loaded in another, it is packed anew and replaced.
- Layout: `MAGIC`, the header's length (u64 little-endian), a JSON header {"source": the GGUF's path, "weights":
  {module name: [offset, nbytes, format, out_features, in_features, padded_in]}}, then the panels, each on a
  64-byte line, from a 4 KB page on. Writing an entry removes those whose GGUF no longer exists.
- A first start moves the packed weights into the new file through a shared map, in place of the huge-page region
  it would otherwise copy them into (kernels/placement.py; the file's pages stream as fast, measured on a Xeon),
  so it writes nothing twice; each loaded buffer goes as its copy is made, so it holds nothing twice either (and a
  GGUF's pages go as each tensor is packed: GGUFFile.release).
- Written aside and renamed: a reader never sees half a file, and a file whose header or sizes do not add up is
  ignored (and replaced). A later start's map is copy-on-write, so a stray write could never reach the file (a first
  start's is the shared map it wrote through).
- The weights are keyed by module name: a linear's (`model.layers.0.mlp.down_proj`), a SegmentedLinear's parts
  (`....qkv_proj.parts.1`) and a packed token embedding (`model.embed_tokens`). The loader takes each one it would
  otherwise pack, checked against the format and shape it expects; anything missing is packed as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from tokenmill.kernels.formats import PackedWeight

log = logging.getLogger("tokenmill.weights")

MAGIC = b"TMPACK01"
ALIGN, PAGE = 64, 4096
_LEN = struct.Struct("<Q")


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill") / "packed"


def cache_path(source: Path, kernels_id: str, sample: bytes) -> Path:
    """The cache file for `source` (a GGUF or a safetensors folder) under kernels `kernels_id`: `<path hash>-<identity
    hash>.bin`. `sample`: bytes of the contents (headers and each tensor's ends), so a file rewritten in place
    within one tick of the clock, at the same size, still gets a new key."""
    resolved = source.resolve()
    st = resolved.stat()
    identity = hashlib.sha256(f"{resolved}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{kernels_id}|".encode())
    identity.update(MAGIC + sample)
    stem = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    return cache_root() / f"{stem}-{identity.hexdigest()[:16]}.bin"


class PackedCache:
    """The packed weights of one GGUF or folder under one kernel build: those the cache file holds (mapped), and a
    tally of the loader's lookups, so that `load` knows whether every weight came from the map."""

    def __init__(self, path: Path, source: Path) -> None:
        self.path, self.source = path, source
        self.weights: dict[str, PackedWeight] = {}
        self.hits = self.misses = 0
        try:
            self.weights = _read(path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable or inconsistent: packed anew, rewritten
            log.info("ignoring the packed-weight cache %s (%s)", path, e)

    def holds(self, name: str, fmt: str, out_features: int, in_features: int) -> bool:
        """Module `name`'s weight is here in this format and shape (nothing counted)."""
        w = self.weights.get(name)
        return w is not None and (w.format, w.out_features, w.in_features) == (fmt, out_features, in_features)

    def take(self, name: str, fmt: str, out_features: int, in_features: int) -> PackedWeight | None:
        """The cached weight of module `name`, if it has this format and shape; else None (counted as a miss)."""
        if not self.holds(name, fmt, out_features, in_features):
            self.misses += 1
            return None
        self.hits += 1
        return self.weights[name]

    @property
    def complete(self) -> bool:
        """Every weight the loader asked for came from the map."""
        return self.hits > 0 and self.misses == 0

    def place(self, model: nn.Module) -> bool:
        """Move every packed weight of `model` into a new cache file, mapped shared, in module order (the order a
        step reads them, as kernels/placement.py places them), then name the file: the weights are the file's
        pages from now on, as on a later start. Each loaded buffer goes as soon as it is copied, so the packed
        weights are never held twice. Older entries of the same source go. False, with the model as it was, where
        the file cannot be made (a read-only or full cache folder)."""
        layout = _layout(model)
        if not layout.groups:
            return False
        staging = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            panels = _create(staging, layout, self.source)
        except OSError as e:
            log.info("no packed-weight cache written to %s (%s)", self.path.parent, e.strerror or e)
            with contextlib.suppress(OSError):
                staging.unlink()
            return False
        try:
            for modules, (begin, nbytes) in zip(layout.groups, layout.spans, strict=True):
                view = panels[begin : begin + nbytes].copy_(modules[0].get_buffer("data").reshape(-1))
                for m in modules:
                    m.data = view  # the loaded buffer's last holder: freed here, before the next is copied
        except BaseException:  # (an interrupt mid-copy: no staging file is left behind)
            with contextlib.suppress(OSError):
                staging.unlink()
            raise
        try:
            staging.rename(self.path)
        except OSError as e:  # the weights stay in the unnamed file's pages; a later start packs again
            log.info("no packed-weight cache named %s (%s)", self.path, e.strerror or e)
            with contextlib.suppress(OSError):
                staging.unlink()
            return True
        self._drop_stale()
        return True

    def _drop_stale(self) -> None:
        """Remove the other entries of this source's path (older files or kernels), and those whose source is gone."""
        stem = self.path.name.partition("-")[0]
        for old in self.path.parent.glob("*.bin"):
            if old == self.path:
                continue
            try:
                if old.name.startswith(f"{stem}-") or not Path(_header(old)["source"]).exists():
                    old.unlink()
            except (OSError, ValueError, KeyError, TypeError):  # gone already, or not ours to judge
                continue


def _packed_modules(model: nn.Module) -> dict[str, tuple[nn.Module, PackedWeight]]:
    """Module name -> (module, its packed weight), for every kernel linear and packed embedding of `model` on the
    CPU."""
    from tokenmill.models.linear import KernelLinear
    from tokenmill.models.packed_embedding import PackedEmbedding

    found: dict[str, tuple[nn.Module, PackedWeight]] = {}
    for name, m in model.named_modules():
        if isinstance(m, KernelLinear) and m.data.device.type == "cpu":
            found[name] = m, m.packed()
        elif isinstance(m, PackedEmbedding):
            found[name] = m, PackedWeight(m.data, m.format, m.num_embeddings, m.embedding_dim, m.padded_dim)
    return found


@dataclass
class _Layout:
    """Where each packed buffer goes in the file. `groups`: the modules holding each buffer (a tied LM head shares
    its embedding's), in module order, and `spans` its (offset, nbytes) among the panels; `table`: the header's
    {module name: [offset, nbytes, format, out, in, padded_in]}; `size`: the panels' bytes."""

    groups: list[list[nn.Module]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    table: dict[str, list[Any]] = field(default_factory=dict)
    size: int = 0


def _layout(model: nn.Module) -> _Layout:
    layout, at = _Layout(), {}  # at: data_ptr -> (its group, offset)
    for name, (m, w) in _packed_modules(model).items():
        ptr = w.data.data_ptr()
        if ptr not in at:
            at[ptr] = len(layout.groups), layout.size
            layout.groups.append([])
            layout.spans.append((layout.size, w.data.numel()))
            layout.size += -(-w.data.numel() // ALIGN) * ALIGN
        group, offset = at[ptr]
        layout.groups[group].append(m)
        layout.table[name] = [offset, w.data.numel(), w.format, w.out_features, w.in_features, w.padded_in]
    return layout


def _create(path: Path, layout: _Layout, source: Path) -> torch.Tensor:
    """The file with its header and its blocks allocated, mapped shared: the panels' bytes (a view of the map)."""
    text = json.dumps({"source": str(source.resolve()), "weights": layout.table}).encode()
    start = -(-(len(MAGIC) + _LEN.size + len(text)) // PAGE) * PAGE
    with open(path, "w+b") as f:
        f.write(MAGIC + _LEN.pack(len(text)) + text)
        os.posix_fallocate(f.fileno(), 0, start + layout.size)  # the blocks now: a full disk fails here, not in the map
        region = mmap.mmap(f.fileno(), start + layout.size, access=mmap.ACCESS_WRITE)
    return torch.frombuffer(region, dtype=torch.uint8)[start:]  # holds the map alive while any view lives


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return _read_header(f)[0]


def _read_header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    """(the header, where the panels start)."""
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) < len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
        raise ValueError("not a packed-weight cache file")
    (length,) = _LEN.unpack(head[len(MAGIC) :])
    header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not an object")
    return header, -(-(len(MAGIC) + _LEN.size + length) // PAGE) * PAGE


def _read(path: Path) -> dict[str, PackedWeight]:
    with open(path, "rb") as f:
        header, start = _read_header(f)
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: the file is never written
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the map alive while any view lives
    weights = {}
    for name, (offset, nbytes, fmt, n, k, padded) in header["weights"].items():
        if start + offset + nbytes > whole.numel():
            raise ValueError(f"{name} runs past the end of the file")
        weights[name] = PackedWeight(whole[start + offset : start + offset + nbytes], str(fmt), n, k, padded)
    return weights

"""The prefix cache's disk tier (`--prefix-cache-dir`): one file per KV block, named by the block's chained hash,
under a folder named by the layout digest (the model's identity, dtype, block size and KV shape:
engine/prefix_tiers.py), so a changed model never reads another's blocks. Pure Python: a block's payload is bytes.

- A file is `_HEADER` (magic, version, layout digest, block hash, payload length, payload digest) then the payload.
  A file whose header, length or digest does not check out is a miss: it is deleted, with one warning line.
- Written to a temporary file in the same folder, then renamed over its final name (`os.replace`): a crash mid-write
  leaves a stray temporary file (removed at the next start once it is old) and never a block that reads back wrong.
- Least recently used files go first when the folder's blocks pass `capacity_bytes`; a read touches the file's mtime,
  so the order survives a restart. Another process may share the folder: a file it removed is only a miss here.
- An `OSError` other than a missing file (an unwritable folder, a full disk) propagates: the caller (tiers.py) turns
  the tier off with one warning line.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("tokenmill.kv_cache")

MAGIC = b"TMKVBLK1"
VERSION = 1
SUFFIX = ".kvblock"
# magic, version, layout digest (32 bytes), block hash (16 bytes, little-endian), payload length, payload digest
_HEADER = struct.Struct("<8sI32s16sQ16s")
_STALE_TMP_S = 600  # a temporary file older than this is a crashed write, not another process's write in flight


def payload_digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class DiskTier:
    """Blocks as files in `root/<layout digest>/`, at most `capacity_bytes` of them, each `block_nbytes` of payload."""

    def __init__(self, root: Path, layout_digest: bytes, block_nbytes: int, capacity_bytes: int) -> None:
        if len(layout_digest) != 32:
            raise ValueError(f"the layout digest must be 32 bytes, got {len(layout_digest)}")
        self.folder = root / layout_digest.hex()[:32]
        self.layout_digest, self.block_nbytes, self.capacity_bytes = layout_digest, block_nbytes, capacity_bytes
        self.file_nbytes = _HEADER.size + block_nbytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._probe()
        self._files: OrderedDict[int, None] = self._scan()  # block hash, least recently used first
        self._evict_to(capacity_bytes)

    @property
    def used_bytes(self) -> int:
        return len(self._files) * self.file_nbytes

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._files

    # ---- reads ----

    def get(self, block_hash: int) -> bytes | None:
        """The block's payload, or None: no such file, or a corrupt one (then deleted, with a warning line)."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read(self.file_nbytes + 1)
        except FileNotFoundError:
            self._files.pop(block_hash, None)
            return None
        problem = self._problem(raw, block_hash)
        if problem is not None:
            log.warning("prefix cache: %s is corrupt (%s); deleted, its block will be recomputed", path, problem)
            self._remove(block_hash)
            return None
        with contextlib.suppress(OSError):  # another process may have removed it since: it was still read whole
            os.utime(path)
        self._files[block_hash] = None
        self._files.move_to_end(block_hash)
        return raw[_HEADER.size :]

    def _problem(self, raw: bytes, block_hash: int) -> str | None:
        """What is wrong with a file's bytes for block `block_hash`, or None."""
        if len(raw) != self.file_nbytes:
            return f"{len(raw)} bytes, expected {self.file_nbytes}"
        magic, version, layout, stored_hash, length, digest = _HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            return f"not a version-{VERSION} block file"
        if layout != self.layout_digest or stored_hash != block_hash.to_bytes(16, "little"):
            return "it holds another model's or another prefix's block"
        if length != self.block_nbytes or digest != payload_digest(raw[_HEADER.size :]):
            return "its payload does not match its digest"
        return None

    # ---- writes ----

    def put(self, block_hash: int, payload: bytes) -> None:
        """Write the block (atomically: temporary file, then rename); a block already here is only touched."""
        if len(payload) != self.block_nbytes:
            raise ValueError(f"a block payload must be {self.block_nbytes} bytes, got {len(payload)}")
        if self.file_nbytes > self.capacity_bytes:
            return
        path = self._path(block_hash)
        if block_hash in self._files and path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)
            self._files.move_to_end(block_hash)
            return
        header = _HEADER.pack(MAGIC, VERSION, self.layout_digest, block_hash.to_bytes(16, "little"), len(payload),
                              payload_digest(payload))  # fmt: skip
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._files[block_hash] = None
        self._evict_to(self.capacity_bytes)

    def _evict_to(self, capacity_bytes: int) -> None:
        while self._files and self.used_bytes > capacity_bytes:
            self._remove(next(iter(self._files)))

    def _remove(self, block_hash: int) -> None:
        self._files.pop(block_hash, None)
        with contextlib.suppress(FileNotFoundError):
            self._path(block_hash).unlink()

    # ---- the folder ----

    def _path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:032x}{SUFFIX}"

    def _probe(self) -> None:
        """Raise OSError now if the folder cannot be written, rather than at the first eviction."""
        probe = self.folder / f".probe.{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()

    def _scan(self) -> OrderedDict[int, None]:
        """The blocks already in the folder, least recently used first; old temporary files are removed."""
        found: list[tuple[float, int]] = []
        now = time.time()
        for entry in os.scandir(self.folder):
            with contextlib.suppress(OSError, ValueError):  # gone meanwhile, or a name that is not a hash
                if entry.name.endswith(".tmp"):
                    if now - entry.stat().st_mtime > _STALE_TMP_S:
                        os.unlink(entry.path)
                elif entry.name.endswith(SUFFIX) and len(entry.name) == 32 + len(SUFFIX):
                    found.append((entry.stat().st_mtime, int(entry.name[:32], 16)))
        return OrderedDict((block_hash, None) for _, block_hash in sorted(found))

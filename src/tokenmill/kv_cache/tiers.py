"""The prefix cache's tiers below the KV pool: host RAM (`--prefix-cache-ram-gb`), then disk (`--prefix-cache-dir`).

A cached block evicted from the pool keeps its KV here, under its chained hash: on disk at once (write-through) and
in RAM, which keeps the most recently used blocks that fit. At shutdown the pool's own cached blocks go to disk too
(`KVCacheManager.flush`), so a restart finds every block the last run computed, as far as the disk's size allows.
A later prompt whose block hashes miss the pool but hit a tier has those blocks copied back into fresh pool blocks
instead of recomputing them (manager.py decides which; the engine core moves the bytes between steps through a
`BlockIO`, the KV pool).

Pure Python: a block's payload is the bytes of every layer's keys and values for its tokens, as the pool holds them
(attention/paged.py `read_block`). Both tiers are inclusive: a block loaded back into the pool stays in its tier.
A tier that fails (an unwritable folder, a full disk) is turned off with one warning line and serving goes on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

from tokenmill.kv_cache.disk_tier import DiskTier

log = logging.getLogger("tokenmill.kv_cache")

TIERS = ("pool", "ram", "disk")  # where a prefix-cache hit was found


class BlockIO(Protocol):
    """The KV pool as bytes, one block at a time (attention/paged.py)."""

    def read_block(self, block_id: int) -> bytes:
        """Every layer's keys and values of the block's tokens."""
        ...

    def write_block(self, block_id: int, data: bytes) -> None:
        """Overwrite the block with what `read_block` gave."""
        ...


class PrefixTiers:
    """A RAM tier of at most `ram_bytes` of block payloads (`block_nbytes` each) over an optional disk tier."""

    def __init__(self, block_nbytes: int, ram_bytes: int, disk: DiskTier | None = None) -> None:
        if block_nbytes < 1 or ram_bytes < 0:
            raise ValueError(f"block_nbytes must be >= 1 and ram_bytes >= 0, got {block_nbytes} and {ram_bytes}")
        self.block_nbytes, self.ram_bytes = block_nbytes, ram_bytes
        self.disk = disk
        self._ram: OrderedDict[int, bytes] = OrderedDict()  # block hash -> payload, least recently used first
        self.blocks_saved = 0  # blocks written to a tier, cumulative
        self.blocks_loaded = 0  # blocks copied back into the pool, cumulative

    def used_bytes(self) -> dict[str, int]:
        """Bytes of blocks each tier holds now."""
        return {"ram": len(self._ram) * self.block_nbytes, "disk": self.disk.used_bytes if self.disk else 0}

    def find(self, block_hash: int) -> tuple[str, bytes] | None:
        """(tier, payload) of the block, RAM first, or None."""
        payload = self._ram.get(block_hash)
        if payload is not None:
            self._ram.move_to_end(block_hash)
            return "ram", payload
        if self.disk is None:
            return None
        try:
            payload = self.disk.get(block_hash)
        except OSError as e:
            self._disk_failed(e)
            return None
        return ("disk", payload) if payload is not None else None

    def refresh(self, block_hash: int) -> bool:
        """Mark the block recently used, if RAM holds it: True. Saves re-reading a block the pool evicts again."""
        if block_hash not in self._ram:
            return False
        self._ram.move_to_end(block_hash)
        return True

    def save(self, block_hash: int, payload: bytes) -> None:
        """Keep an evicted block: on disk at once (write-through, so a restart finds it), and in RAM, which drops its
        least recently used blocks past its size."""
        if len(payload) != self.block_nbytes:
            raise ValueError(f"a block payload must be {self.block_nbytes} bytes, got {len(payload)}")
        self.blocks_saved += 1
        self.write_disk(block_hash, payload)
        if self.ram_bytes < self.block_nbytes:
            return
        self._ram[block_hash] = payload
        self._ram.move_to_end(block_hash)
        while len(self._ram) * self.block_nbytes > self.ram_bytes:
            self._ram.popitem(last=False)

    def on_disk(self, block_hash: int) -> bool:
        return self.disk is not None and block_hash in self.disk

    def write_disk(self, block_hash: int, payload: bytes) -> None:
        """Write the block to the disk tier, if there is one (a failure turns the tier off, in one warning line)."""
        if self.disk is None:
            return
        try:
            self.disk.put(block_hash, payload)
        except OSError as e:
            self._disk_failed(e)

    def _disk_failed(self, error: OSError) -> None:
        assert self.disk is not None
        log.warning("prefix cache: the disk tier in %s failed (%s); going on without it", self.disk.folder, error)
        self.disk = None

"""The block pool: reference counts, the LRU free queue and the prefix-cache map, over block ids 0..N-1.

A block is either *referenced* (ref count > 0, owned by one or more block tables) or *free* (ref count 0, in the
free queue). A free block may still be *cached*: it keeps its hash and can be handed back to a new request by a
prefix hit until it reaches the head of the free queue and is evicted for reuse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Owns blocks 0..num_blocks-1: ref counts, a free queue in eviction order, and the hash -> block id map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hashes: list[int | None] = [None] * num_blocks
        # NOTE: an OrderedDict keyed by block id is the free queue: head = next to evict, tail = most recently
        # freed; popitem(last=False), insertion and `del` of any key are all O(1). Initially ids in order 0..N-1.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        # block hash -> the block `allocate` evicted it from, since the last `take_evictions`; None: not recorded (no
        # tier below the pool). The block's contents stand until the step that reuses it runs.
        self._evictions: dict[int, int] | None = None

    # ---- queries ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not (cached free blocks are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix-cache map, referenced or free."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The hash a block is registered under, or None if it is not in the prefix cache."""
        return self._block_hashes[block_id]

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block registered under `block_hash`, or None. Takes no reference."""
        return self._cached.get(block_hash)

    def cached_blocks(self) -> dict[int, int]:
        """A copy of the hash -> block id map."""
        return dict(self._cached)

    def free_queue(self) -> list[int]:
        """The free block ids in eviction order (head first); a copy."""
        return list(self._free)

    # ---- state changes ----

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop `num_blocks` blocks from the free queue head, evicting their hashes; each gets ref count 1."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id = self._free.popitem(last=False)[0]
            block_hash = self._block_hashes[block_id]
            if block_hash is not None and self._evictions is not None:
                self._evictions[block_hash] = block_id
            self._evict_hash(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference on each block; a free block (e.g. a prefix hit) leaves the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given; those reaching 0 join the free queue tail."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} released with ref count {self._ref_counts[block_id]}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                # NOTE: a cached block keeps its hash here; it is only forgotten when evicted at the queue head.
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full block under `block_hash`. False (nothing changes) if the hash already names a block
        or the block is already registered."""
        if block_hash in self._cached or self._block_hashes[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self._block_hashes[block_id] = block_hash
        return True

    def record_evictions(self) -> None:
        """From now on remember which cached blocks `allocate` evicts (`take_evictions`)."""
        if self._evictions is None:
            self._evictions = {}

    def take_evictions(self) -> dict[int, int]:
        """The hashes evicted since the last call, each with the block that still holds its KV; forgets them."""
        if self._evictions is None:
            return {}
        evicted, self._evictions = self._evictions, {}
        return evicted

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False, nothing changes) while any block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hashes = [None] * self.num_blocks
        return True

    def forget(self, block_id: int) -> None:
        """Drop the block's hash (its contents were never written: a failed step), so no prefix lookup finds it."""
        self._evict_hash(block_id)

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._block_hashes[block_id] = None

    # ---- invariants ----

    def check_integrity(self) -> None:
        """Raise AssertionError if any pool invariant is broken."""
        assert len(self._ref_counts) == self.num_blocks and len(self._block_hashes) == self.num_blocks
        for block_id in self._free:
            assert 0 <= block_id < self.num_blocks, f"free queue holds out-of-range block {block_id}"
        for block_id, ref in enumerate(self._ref_counts):
            assert ref >= 0, f"block {block_id} has negative ref count {ref}"
            in_free = block_id in self._free
            assert (ref == 0) == in_free, f"block {block_id}: ref count {ref} but in free queue = {in_free}"
        assert len(set(self._cached.values())) == len(self._cached), "two hashes map to the same block"
        for block_hash, block_id in self._cached.items():
            stored = self._block_hashes[block_id]
            assert stored == block_hash, f"block {block_id} stores hash {stored}, map says {block_hash}"
        num_hashed = sum(h is not None for h in self._block_hashes)
        assert num_hashed == len(self._cached), f"{num_hashed} blocks store a hash but the map has {len(self._cached)}"
        assert self.num_free_blocks == len(self._free)

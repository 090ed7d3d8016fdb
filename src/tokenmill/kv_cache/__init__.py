"""The paged KV cache's bookkeeping: pure Python, no tensors. The runner owns the KV tensors; this package
only decides which block ids each request's tokens live in.

- `BlockPool` (block_pool.py): `num_blocks` fixed-size blocks with reference counts, a free queue kept in
  LRU order, and the prefix-cache map from block hash to block id.
- `KVCacheManager` (manager.py): per-request block tables on top of the pool; the scheduler's only door.
- `UnpagedKVManager` (unpaged.py): the same calls for the baselines with no blocks (contiguous, recompute).
- `KVManager`: either of them, which is all the scheduler sees.
- `PrefixTiers` (tiers.py, over `DiskTier` in disk_tier.py): host RAM and disk below the pool, where evicted cached
  blocks go and from where a later prefix hit loads them back.
- `hash_block_tokens` (hashing.py): a full block's hash is chained over its parent block's hash and its own
  token ids, so equal hashes mean equal whole prefixes.
"""

from __future__ import annotations

from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.disk_tier import DiskTier
from tokenmill.kv_cache.hashing import hash_block_tokens
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.kv_cache.tiers import TIERS, BlockIO, PrefixTiers
from tokenmill.kv_cache.unpaged import UnpagedKVManager

# What the scheduler holds: block accounting for the paged cache, or none for the unpaged baselines.
KVManager = KVCacheManager | UnpagedKVManager


__all__ = [
    "TIERS",
    "BlockIO",
    "BlockPool",
    "DiskTier",
    "KVCacheManager",
    "KVManager",
    "PrefixTiers",
    "UnpagedKVManager",
    "hash_block_tokens",
]

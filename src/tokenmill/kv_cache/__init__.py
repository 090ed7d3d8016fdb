"""The paged KV cache's bookkeeping: pure Python, no tensors. The runner owns the KV tensors; this package
only decides which block ids each request's tokens live in.

- `BlockPool` (block_pool.py): `num_blocks` fixed-size blocks with reference counts, a free queue kept in
  LRU order, and the prefix-cache map from block hash to block id.
- `KVCacheManager` (manager.py): per-request block tables on top of the pool; the scheduler's only door.
- `hash_block_tokens` (hashing.py): a full block's hash is chained over its parent block's hash and its own
  token ids, so equal hashes mean equal whole prefixes.
"""

from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.hashing import hash_block_tokens
from tokenmill.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager", "hash_block_tokens"]

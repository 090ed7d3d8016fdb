"""The KV manager of the baselines that keep no block accounting: the contiguous store (one buffer per
sequence, sized when it starts) and recompute (no cache at all).

It answers the scheduler's calls the way an unlimited pool with prefix caching off would: every allocation
fits, nothing is cached, nothing is shared. So the scheduler has one code path for every KV mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from tokenmill.kv_cache.tiers import TIERS, BlockIO


class UnpagedKVManager:
    num_blocks = 0
    block_size = 0
    num_free_blocks = 0
    usage = 0.0
    prefix_cache_queries = 0
    prefix_cache_hits = 0
    prefix_cache_hits_by_tier = MappingProxyType(dict.fromkeys(TIERS, 0))
    tiers = None

    def num_blocks_needed(self, num_tokens: int) -> int:
        return 0

    def tier_bytes(self) -> dict[str, int]:
        return {"ram": 0, "disk": 0}

    def block_table(self, request_id: str) -> list[int]:
        return []

    def get_computed_blocks(self, token_ids: Sequence[int], salt: int | None = None) -> tuple[list[int], int]:
        return [], 0

    def allocate_slots(self, request_id: str, *args: object, **kwargs: object) -> bool:
        return True  # unlimited: the contiguous store sizes each sequence when it starts

    def fork(self, src_id: str, dst_id: str, num_tokens: int) -> int:
        return 0

    def cache_computed(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        pass

    def forget_from(self, request_id: str, num_tokens: int) -> list[int]:
        return []

    def free(self, request_id: str) -> None:
        pass

    def move_blocks(self, pool: BlockIO | None) -> None:
        pass

    def flush(self, pool: BlockIO | None) -> None:
        pass

    def check_integrity(self) -> None:
        pass

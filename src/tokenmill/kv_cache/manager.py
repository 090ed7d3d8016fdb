"""Per-request block tables on top of the block pool: the scheduler's only door into the KV cache.

The scheduler drives one request through `get_computed_blocks` (prefix hit, new requests only), then
`allocate_slots` every step it runs, `fork` for n > 1 sampling, and `free` when it finishes or is preempted.
Everything here is block ids and token ids; the runner turns block tables into slot mappings.

With tiers below the pool (`use_tiers`, tiers.py), a prefix lookup goes on past the pool's blocks into the tiers:
their blocks count as computed, `allocate_slots` gives them fresh pool blocks, and `move_blocks`, which the engine
core calls after scheduling and before the step runs, saves the blocks the pool evicted and loads those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.hashing import hash_block_tokens
from tokenmill.kv_cache.tiers import TIERS, BlockIO, PrefixTiers


@dataclass
class _RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    # NOTE: chained hashes of the request's leading full blocks, one per block in [0, num_tokens // block_size)
    # when prefix caching is on (always empty when off); kept so hashing on each step is incremental.
    block_hashes: list[int] = field(default_factory=list)
    num_tokens: int = 0  # highest num_computed_tokens + num_new_tokens allocated so far (lookahead excluded)
    salt: int | None = None  # the first block's hash chains on it (a LoRA adapter's digest): None for the base model


class KVCacheManager:
    """Block tables for requests over a pool of `num_blocks` blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0  # tokens looked up by get_computed_blocks, cumulative
        self.prefix_cache_hits = 0  # tokens those lookups covered, cumulative
        self.prefix_cache_hits_by_tier = dict.fromkeys(TIERS, 0)  # of which found in the pool, in RAM, on disk
        self.tiers: PrefixTiers | None = None
        self._staged: dict[int, tuple[str, bytes]] = {}  # hash -> (tier, KV) a lookup found, until `move_blocks`
        self._loads: list[tuple[int, int]] = []  # (block id, hash): blocks to fill from `_staged` before the step

    def use_tiers(self, tiers: PrefixTiers) -> None:
        """Keep evicted cached blocks in `tiers`, and find prefixes there too (needs prefix caching)."""
        if not self.enable_prefix_caching:
            raise ValueError("prefix-cache tiers need prefix caching on")
        self.tiers = tiers
        self.block_pool.record_evictions()

    # ---- queries ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached-but-unreferenced blocks count: they are evictable)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of KV blocks the RAM and disk tiers hold now (0 without them)."""
        return self.tiers.used_bytes() if self.tiers is not None else {"ram": 0, "disk": 0}

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids in token order; [] for an unknown request."""
        req = self._requests.get(request_id)
        return list(req.block_ids) if req is not None else []

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, token_ids: Sequence[int], salt: int | None = None) -> tuple[list[int], int]:
        """Prefix-cache lookup for a new request: (block ids, tokens covered) of the longest run of leading full
        blocks whose chained hashes are cached. Never covers every token (the last one must be computed for its
        logits). Takes no references: pass the result to `allocate_slots` in the same scheduling step. `salt`: the
        first block's hash chains on it (a LoRA adapter's requests see only blocks computed with that adapter)."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        # NOTE: (n - 1) // bs full blocks at most, so at least one token is always left to compute.
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        block_ids: list[int] = []
        num_tier_blocks = 0  # after the pool's blocks: blocks a tier holds (`_stage`), loaded before the step
        parent: int | None = salt
        for i in range(max_blocks):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self.block_pool.get_cached_block(parent)
            if block_id is not None and not num_tier_blocks:
                block_ids.append(block_id)
                self.prefix_cache_hits_by_tier["pool"] += bs
            elif block_id is None and self._stage(parent):
                num_tier_blocks += 1
            else:  # NOTE: a pool block after a tier's would need its own place in the table; the rest is computed
                break
        num_hit_tokens = (len(block_ids) + num_tier_blocks) * bs
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        return block_ids, num_hit_tokens

    def _stage(self, block_hash: int) -> bool:
        """Find the block in a tier and hold its KV until `move_blocks`: True if found. (A block the pool evicted in
        this step is saved by `move_blocks`; until then a tier has it only from an earlier save, of the same bytes.)"""
        if self.tiers is None:
            return False
        found = self._staged.get(block_hash) or self.tiers.find(block_hash)
        if found is None:
            return False
        self._staged[block_hash] = found
        self.prefix_cache_hits_by_tier[found[0]] += self.block_size
        return True

    # ---- state changes ----

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
        salt: int | None = None,
    ) -> bool:
        """Grow the request's block table to cover `num_computed_tokens + num_new_tokens` tokens (plus
        `num_lookahead_tokens` unhashed slots, e.g. for speculative tokens). False, with nothing changed, if the
        pool has too few free blocks.

        `token_ids` are the request's known tokens, at least `num_computed_tokens + num_new_tokens` of them; with
        prefix caching, every block that becomes full within that range is registered under its chained hash.
        `salt`: the lookup's, for a request with no blocks yet (kept for its later hashes).
        `new_computed_blocks` (from `get_computed_blocks`, only for a request with no blocks yet) start the table
        and are already counted in `num_computed_tokens`; so are the blocks that lookup found in a tier, which follow
        them: they take fresh blocks here, filled by `move_blocks` before the step.
        """
        num_tokens = num_computed_tokens + num_new_tokens
        req = self._requests.get(request_id)
        old_block_ids = req.block_ids if req is not None else []
        old_hashes = req.block_hashes if req is not None else []
        num_hits = len(new_computed_blocks)
        num_tier = 0 if old_block_ids or not self._staged else max(0, num_computed_tokens // self.block_size - num_hits)
        self._check_allocation(request_id, len(token_ids), num_computed_tokens, num_new_tokens, new_computed_blocks,
                               num_lookahead_tokens, len(old_block_ids), num_tier)  # fmt: skip
        num_table_blocks = len(old_block_ids) + num_hits

        # Hash first (no side effects) so a stale or wrong new_computed_blocks fails before anything changes.
        salt = req.salt if req is not None else salt
        new_hashes = self._hash_new_full_blocks(old_hashes, token_ids, num_tokens, salt)
        for i, block_id in enumerate(new_computed_blocks):
            if self.block_pool.block_hash(block_id) != new_hashes[i]:
                raise ValueError(f"computed block {block_id} no longer holds this prompt's block {i} (evicted?)")
        for i in range(num_hits, num_hits + num_tier):
            if new_hashes[i] not in self._staged:
                raise ValueError(f"this prompt's block {i} is counted as computed but no lookup found it in a tier")

        num_required = max(0, self.num_blocks_needed(num_tokens + num_lookahead_tokens) - num_table_blocks)
        # NOTE: prefix-hit blocks with ref count 0 sit in the free queue; taking them shrinks what is left to pop.
        num_reclaimed = sum(1 for b in new_computed_blocks if self.block_pool.ref_count(b) == 0)
        if num_required > self.num_free_blocks - num_reclaimed:
            return False

        if req is None:
            req = self._requests[request_id] = _RequestBlocks(salt=salt)
        # NOTE: touch the hit blocks before popping fresh ones, or the pop could evict one of them.
        self.block_pool.touch(new_computed_blocks)
        req.block_ids.extend(new_computed_blocks)
        req.block_ids.extend(self.block_pool.allocate(num_required))
        self._loads += [(req.block_ids[i], new_hashes[i]) for i in range(num_hits, num_hits + num_tier)]
        for i, block_hash in enumerate(new_hashes, start=len(req.block_hashes)):
            # A no-op for hit blocks (already registered) and when another block already holds this hash.
            self.block_pool.cache_block(req.block_ids[i], block_hash)
        req.block_hashes.extend(new_hashes)
        req.num_tokens = max(req.num_tokens, num_tokens)
        return True

    def _check_allocation(
        self,
        request_id: str,
        num_token_ids: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int],
        num_lookahead_tokens: int,
        num_old_blocks: int,
        num_tier_blocks: int,
    ) -> None:
        """allocate_slots' arguments, checked against each other and the request's table before anything changes:
        a ValueError naming what is wrong."""
        bs = self.block_size
        num_tokens = num_computed_tokens + num_new_tokens
        if num_computed_tokens < 0 or num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_computed_tokens={num_computed_tokens}, "
                f"num_new_tokens={num_new_tokens}, num_lookahead_tokens={num_lookahead_tokens}"
            )
        if num_token_ids < num_tokens:
            raise ValueError(f"request {request_id!r}: {num_token_ids} token ids given, {num_tokens} to allocate")
        if new_computed_blocks:
            if num_old_blocks:
                raise ValueError(f"request {request_id!r} already has blocks; new_computed_blocks is for new requests")
            if not self.enable_prefix_caching:
                raise ValueError("new_computed_blocks given but prefix caching is disabled")
            if len(new_computed_blocks) * bs > num_computed_tokens:
                raise ValueError(
                    f"{len(new_computed_blocks)} computed blocks cover {len(new_computed_blocks) * bs} tokens, "
                    f"more than num_computed_tokens={num_computed_tokens}"
                )
        num_table_blocks = num_old_blocks + len(new_computed_blocks) + num_tier_blocks
        if num_computed_tokens > num_table_blocks * bs:
            raise ValueError(
                f"request {request_id!r}: num_computed_tokens={num_computed_tokens} but its blocks hold only "
                f"{num_table_blocks * bs} tokens"
            )

    def fork(self, src_id: str, dst_id: str, num_tokens: int) -> int:
        """Share src's full blocks covering its first `num_tokens` tokens with dst (which has no blocks yet),
        taking a reference on each. Returns the tokens shared, a multiple of block_size; dst recomputes the rest."""
        src = self._requests.get(src_id)
        if src is None:
            raise ValueError(f"fork: unknown source request {src_id!r}")
        if src_id == dst_id:
            raise ValueError(f"fork: source and destination are the same request {src_id!r}")
        dst = self._requests.get(dst_id)
        if dst is not None and dst.block_ids:
            raise ValueError(f"fork: destination {dst_id!r} already has {len(dst.block_ids)} blocks")
        if not 0 <= num_tokens <= src.num_tokens:
            raise ValueError(f"fork: num_tokens={num_tokens} outside [0, {src.num_tokens}] allocated for {src_id!r}")
        num_shared_blocks = num_tokens // self.block_size
        shared = src.block_ids[:num_shared_blocks]
        self.block_pool.touch(shared)
        self._requests[dst_id] = _RequestBlocks(
            block_ids=list(shared),
            block_hashes=src.block_hashes[:num_shared_blocks],
            num_tokens=num_shared_blocks * self.block_size,
            salt=src.salt,
        )
        return num_shared_blocks * self.block_size

    def cache_computed(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register for the prefix cache the full blocks that the request's first `num_computed_tokens` tokens fill
        and that allocation left unhashed (lookahead slots a decode run or kept drafts wrote). No-op for an
        unknown request or without prefix caching."""
        req = self._requests.get(request_id)
        if req is None:
            return
        if num_computed_tokens > min(len(token_ids), len(req.block_ids) * self.block_size):
            raise ValueError(f"request {request_id!r}: {num_computed_tokens} computed tokens, but it has "
                             f"{len(token_ids)} token ids in {len(req.block_ids)} blocks")  # fmt: skip
        new_hashes = self._hash_new_full_blocks(req.block_hashes, token_ids, num_computed_tokens, req.salt)
        for i, block_hash in enumerate(new_hashes, start=len(req.block_hashes)):
            self.block_pool.cache_block(req.block_ids[i], block_hash)
        req.block_hashes.extend(new_hashes)

    def forget_from(self, request_id: str, num_tokens: int) -> list[int]:
        """The request's KV from token `num_tokens` on was never written (its step failed): the blocks holding it
        lose their hashes, so that no prefix lookup takes them, this request's own next try included. Returns
        those blocks."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        first = num_tokens // self.block_size
        for block_id in req.block_ids[first:]:
            self.block_pool.forget(block_id)
        del req.block_hashes[first:]
        return req.block_ids[first:]

    def free(self, request_id: str) -> None:
        """Drop the request's references (unknown id: no-op). Freed blocks join the free queue tail in reverse
        table order, so a sequence's last blocks are evicted first; cached ones stay reusable until evicted."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.block_pool.release(reversed(req.block_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; refused (False) while any block is referenced by a request."""
        return self.block_pool.reset_prefix_cache()

    def move_blocks(self, pool: BlockIO | None) -> None:
        """Between scheduling and the step (the engine core calls it every step): the cached blocks this step's
        allocations evicted go to the tiers, read while the pool still holds them; then the blocks lookups found in a
        tier are written into the fresh blocks given to them. No-op without tiers."""
        evicted, loads, staged = self.block_pool.take_evictions(), self._loads, self._staged
        self._loads, self._staged = [], {}
        if self.tiers is None or pool is None:
            return
        for block_hash, block_id in evicted.items():
            if not self.tiers.refresh(block_hash):
                self.tiers.save(block_hash, pool.read_block(block_id))
        for block_id, block_hash in loads:
            pool.write_block(block_id, staged[block_hash][1])
        self.tiers.blocks_loaded += len(loads)

    def _hash_new_full_blocks(
        self, known: list[int], token_ids: Sequence[int], num_tokens: int, salt: int | None
    ) -> list[int]:  # fmt: skip
        """Chained hashes of the full blocks in [len(known), num_tokens // block_size) (the first on `salt`); [] without
        caching."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent = known[-1] if known else salt
        hashes: list[int] = []
        for i in range(len(known), num_tokens // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def flush(self, pool: BlockIO | None) -> None:
        """At shutdown: write the cached blocks the pool still holds to the disk tier (if any), so that a restart over
        the same folder finds them. Every registered block has been computed by then: a step runs right after the
        scheduling that registers its blocks, and a failed one's blocks lose their hashes (`forget_from`)."""
        if self.tiers is None or pool is None:
            return
        for block_hash, block_id in self.block_pool.cached_blocks().items():
            if self.tiers.disk is None:
                return
            if not self.tiers.on_disk(block_hash):
                self.tiers.write_disk(block_hash, pool.read_block(block_id))

    # ---- invariants ----

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool or any block table breaks an invariant."""
        self.block_pool.check_integrity()
        assert self.num_free_blocks == len(self.block_pool.free_queue())
        occurrences: Counter[int] = Counter()
        for request_id, req in self._requests.items():
            block_ids, hashes = req.block_ids, req.block_hashes
            assert len(set(block_ids)) == len(block_ids), f"request {request_id!r} holds a block twice: {block_ids}"
            occurrences.update(block_ids)
            assert len(block_ids) * self.block_size >= req.num_tokens, f"request {request_id!r}: table too short"
            expected_hashes = req.num_tokens // self.block_size if self.enable_prefix_caching else 0
            assert len(hashes) == expected_hashes, f"request {request_id!r}: {len(hashes)} hashes, {expected_hashes=}"
            for i, block_id in enumerate(block_ids):
                stored = self.block_pool.block_hash(block_id)
                # NOTE: a registered block in a table sits where its hash says; unhashed positions hold no hash.
                allowed = (None, hashes[i]) if i < len(hashes) else (None,)
                assert stored in allowed, f"request {request_id!r} block {block_id} at {i} stores hash {stored}"
        for block_id in range(self.num_blocks):
            ref = self.block_pool.ref_count(block_id)
            assert ref == occurrences[block_id], f"block {block_id}: ref count {ref}, in {occurrences[block_id]} tables"
        for block_id, block_hash in self._loads:  # a block waiting for its KV from a tier is some request's
            assert occurrences[block_id] and block_hash in self._staged, f"block {block_id} to load is orphaned"

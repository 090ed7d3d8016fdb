"""The paged KV cache bookkeeping: exact block ids, prefix hits, LRU eviction, and a random-ops state machine."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.kv_cache import KVCacheManager, hash_block_tokens


def snapshot(mgr: KVCacheManager, request_ids: list[str]) -> tuple[Any, ...]:
    pool = mgr.block_pool
    return (
        {rid: mgr.block_table(rid) for rid in request_ids},
        pool.free_queue(),
        pool.cached_blocks(),
        [pool.ref_count(b) for b in range(mgr.num_blocks)],
        mgr.num_free_blocks,
    )


def admit(mgr: KVCacheManager, rid: str, prompt: list[int]) -> tuple[bool, int]:
    """A new request as the scheduler runs it: prefix lookup, then allocate the whole rest of the prompt."""
    hit_blocks, num_hit = mgr.get_computed_blocks(prompt)
    ok = mgr.allocate_slots(rid, prompt, num_hit, len(prompt) - num_hit, hit_blocks)
    return ok, num_hit


# ---- hashing ----


def test_hash_is_chained_and_order_sensitive() -> None:
    h = hash_block_tokens(None, [1, 2])
    assert h == hash_block_tokens(None, (1, 2))
    assert h != hash_block_tokens(None, [2, 1])
    assert h != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(h, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(h, [3, 4]) != hash_block_tokens(h + 1, [3, 4])


def test_hash_is_stable_across_processes_and_kv_cache_is_torch_free() -> None:
    code = (
        "import sys; from tokenmill.kv_cache import hash_block_tokens as h;"
        "assert 'torch' not in sys.modules, 'kv_cache imported torch';"
        "print(h(h(None, [1, 2, 3]), [4, 5, 6]))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [4, 5, 6]))}


# ---- exact block ids ----


def test_lru_order_and_reverse_free() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert mgr.allocate_slots("a", list(range(10)), 0, 10)
    assert mgr.allocate_slots("b", list(range(5)), 0, 5)
    assert mgr.block_table("a") == [0, 1, 2] and mgr.block_table("b") == [3, 4]
    assert mgr.num_free_blocks == 3 and mgr.usage == pytest.approx(5 / 8)
    mgr.free("a")
    # Never-used blocks first, then a's blocks last-to-first.
    assert mgr.block_pool.free_queue() == [5, 6, 7, 2, 1, 0]
    assert mgr.allocate_slots("c", list(range(16)), 0, 16)
    assert mgr.block_table("c") == [5, 6, 7, 2]
    mgr.free("b")
    mgr.free("b")  # unknown now: a no-op, not a double free
    mgr.free("never-seen")
    assert mgr.block_pool.free_queue() == [1, 0, 4, 3]
    mgr.check_integrity()


def test_prefix_hit_shares_full_blocks_only() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # 2.5 blocks
    assert admit(mgr, "a", prompt) == (True, 0)
    assert mgr.block_table("a") == [0, 1, 2]
    assert mgr.get_computed_blocks(prompt) == ([0, 1], 8)
    assert admit(mgr, "b", prompt) == (True, 8)
    assert mgr.block_table("b") == [0, 1, 3]
    pool = mgr.block_pool
    assert [pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert pool.block_hash(2) is None and pool.block_hash(3) is None  # partial tails are never cached
    mgr.check_integrity()
    # Once a is gone its shared blocks stay referenced by b; only a's private tail is free.
    mgr.free("a")
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    mgr.check_integrity()


def test_exact_multiple_prompt_leaves_last_block_to_compute() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    assert admit(mgr, "a", prompt) == (True, 0)
    assert all(mgr.block_pool.block_hash(b) is not None for b in mgr.block_table("a"))
    assert mgr.get_computed_blocks(prompt) == ([0, 1], 8)
    assert mgr.get_computed_blocks([*prompt, 99]) == ([0, 1, 2], 12)
    assert mgr.get_computed_blocks(prompt[:4]) == ([], 0)
    assert mgr.get_computed_blocks([]) == ([], 0)
    assert admit(mgr, "b", prompt) == (True, 8)
    assert mgr.block_table("b") == [0, 1, 3]
    mgr.check_integrity()


def test_hit_blocks_are_taken_before_fresh_blocks_are_popped() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    assert admit(mgr, "a", [1, 2, 3]) == (True, 0)
    assert admit(mgr, "c", [9, 9, 9]) == (True, 0)
    mgr.free("a")
    mgr.free("c")
    assert mgr.block_pool.free_queue() == [1, 0, 3, 2]  # the cached hit block 0 is next to evict
    assert admit(mgr, "b", [1, 2, 7, 7, 7]) == (True, 2)
    assert mgr.block_table("b") == [0, 1, 3]
    mgr.check_integrity()


def test_eviction_forgets_hash_of_lru_cached_block() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    prompt_a = [1, 2, 3, 4]
    assert admit(mgr, "a", prompt_a) == (True, 0)
    hash_a1 = hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])
    assert mgr.block_pool.get_cached_block(hash_a1) == 1
    mgr.free("a")
    assert mgr.block_pool.free_queue() == [2, 3, 1, 0]
    assert mgr.num_free_blocks == 4  # cached-but-free blocks count as free
    assert admit(mgr, "b", [7, 8, 9, 10, 11, 12]) == (True, 0)
    assert mgr.block_table("b") == [2, 3, 1]  # block 1 (a's last block) evicted first
    assert mgr.block_pool.get_cached_block(hash_a1) is None
    assert mgr.block_pool.block_hash(0) == hash_block_tokens(None, [1, 2])
    mgr.free("b")
    assert mgr.get_computed_blocks([*prompt_a, 5]) == ([0], 2)
    mgr.check_integrity()


def test_failed_allocation_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    assert admit(mgr, "a", [1, 2, 3, 4, 5]) == (True, 0)
    assert mgr.allocate_slots("c", [9, 9], 0, 2)
    assert mgr.block_table("a") == [0, 1, 2] and mgr.block_table("c") == [3]
    mgr.free("a")  # free queue: 2, 1, 0 with 0 and 1 cached
    ids = ["a", "b", "c"]
    before = snapshot(mgr, ids)
    queries, hits = mgr.prefix_cache_queries, mgr.prefix_cache_hits
    prompt_b = [1, 2, 3, 4, 6, 7, 8, 9]
    hit_blocks, num_hit = mgr.get_computed_blocks(prompt_b)
    assert (hit_blocks, num_hit) == ([0, 1], 4)
    # 3 free blocks, but taking the two hits leaves 1 for the 2 fresh ones needed.
    assert not mgr.allocate_slots("b", prompt_b, num_hit, 4, hit_blocks)
    assert snapshot(mgr, ids) == before
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (queries + 8, hits + 4)
    assert not mgr.allocate_slots("c", [9] * 20, 1, 19)
    assert snapshot(mgr, ids) == before
    mgr.check_integrity()
    assert mgr.allocate_slots("b", prompt_b, num_hit, 2, hit_blocks)  # one fresh block fits
    assert mgr.block_table("b") == [0, 1, 2]
    mgr.check_integrity()


def test_fork_shares_only_full_blocks() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    assert admit(mgr, "a", prompt) == (True, 0)
    assert mgr.fork("a", "a#1", 10) == 8
    assert mgr.block_table("a#1") == [0, 1]
    assert [mgr.block_pool.ref_count(b) for b in range(3)] == [2, 2, 1]
    assert mgr.allocate_slots("a#1", prompt, 8, 2)
    assert mgr.block_table("a#1") == [0, 1, 3]
    assert mgr.fork("a", "a#2", 3) == 0 and mgr.block_table("a#2") == []
    with pytest.raises(ValueError, match="num_tokens"):
        mgr.fork("a", "a#3", 11)
    with pytest.raises(ValueError, match="already has"):
        mgr.fork("a", "a#1", 8)
    mgr.check_integrity()
    for rid in ("a", "a#1", "a#2"):
        mgr.free(rid)
    assert mgr.num_free_blocks == 8
    mgr.check_integrity()


def test_prefix_caching_off_hashes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    assert admit(mgr, "a", prompt) == (True, 0)
    assert mgr.get_computed_blocks(prompt) == ([], 0)
    assert admit(mgr, "b", prompt) == (True, 0)
    assert mgr.block_table("b") == [3, 4, 5]
    assert mgr.block_pool.num_cached_blocks == 0
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (0, 0)
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        mgr.allocate_slots("c", prompt, 2, 3, [0])
    mgr.check_integrity()


def test_decode_growth_adds_blocks_at_boundaries() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [5, 6, 7]
    assert mgr.allocate_slots("a", tokens, 0, 3)
    for n in range(4, 14):
        tokens.append(n)
        assert mgr.allocate_slots("a", tokens, n - 1, 1)
        table = mgr.block_table("a")
        assert len(table) == mgr.num_blocks_needed(n) == -(-n // 4)
        assert table == list(range(len(table)))
        assert [mgr.block_pool.block_hash(b) is not None for b in table] == [i < n // 4 for i in range(len(table))]
    # Hashed one block at a time while decoding, yet chained exactly like a whole-prompt lookup.
    assert mgr.get_computed_blocks(tokens) == ([0, 1, 2], 12)
    # Lookahead slots are allocated but their (unknown) tokens are not hashed.
    assert mgr.allocate_slots("a", tokens, 13, 0, num_lookahead_tokens=4)
    assert mgr.block_table("a") == [0, 1, 2, 3, 4]
    assert mgr.block_pool.block_hash(3) is None and mgr.block_pool.block_hash(4) is None
    mgr.check_integrity()


def test_prefix_counters_and_reset() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    assert admit(mgr, "a", prompt) == (True, 0)
    assert admit(mgr, "b", prompt) == (True, 4)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (10, 4)
    assert not mgr.reset_prefix_cache()
    mgr.free("a")
    mgr.free("b")
    assert mgr.usage == 0.0
    assert mgr.reset_prefix_cache()
    assert mgr.block_pool.num_cached_blocks == 0
    assert mgr.get_computed_blocks(prompt) == ([], 0)
    mgr.check_integrity()


def test_duplicate_content_keeps_first_mapping() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    assert mgr.allocate_slots("a", prompt, 0, 5)
    assert mgr.allocate_slots("b", prompt, 0, 5)  # computed without a lookup: same content, other blocks
    assert mgr.block_pool.cached_blocks() == {
        hash_block_tokens(None, [1, 2]): 0,
        hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4]): 1,
    }
    mgr.check_integrity()
    mgr.free("a")
    mgr.free("b")
    assert mgr.get_computed_blocks(prompt) == ([0, 1], 4)
    mgr.check_integrity()


def test_stale_computed_blocks_are_rejected() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    assert admit(mgr, "a", [1, 2, 3]) == (True, 0)
    mgr.free("a")
    hit_blocks, num_hit = mgr.get_computed_blocks([1, 2, 3])
    assert mgr.allocate_slots("x", [8] * 8, 0, 8)  # evicts everything, including the hit
    mgr.free("x")
    with pytest.raises(ValueError, match="no longer holds"):
        mgr.allocate_slots("b", [1, 2, 3], num_hit, 1, hit_blocks)
    mgr.check_integrity()


# ---- random operations ----

BASES = [list(range(1, 13)), [1, 2, 3, 4, 9, 9, 9, 9, 9], [5] * 12, [1, 2, 7, 7, 3, 4]]


@dataclass
class ShadowRequest:
    tokens: list[int]
    num_computed: int


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler and a runner would, writing each computed token into a shadow copy of
    the KV cache so that every prefix hit can be checked against what its blocks really hold. A slot's KV depends
    on the token, its position and everything before it, so the shadow stores the whole prefix up to that slot."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(1, 1)
        self.reqs: dict[str, ShadowRequest] = {}
        self.shadow: dict[int, list[tuple[int, ...] | None]] = {}  # block id -> prefix written into each slot
        self.next_id = 0

    @initialize(num_blocks=st.integers(8, 16), block_size=st.integers(2, 4), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)

    def _pick(self, index: int) -> str:
        return sorted(self.reqs)[index % len(self.reqs)]

    def _compute(self, rid: str, start: int, count: int, lookahead: int = 0) -> None:
        """The runner writing KV for tokens [start, start + count), plus draft garbage in lookahead slots."""
        bs, table, tokens = self.mgr.block_size, self.mgr.block_table(rid), self.reqs[rid].tokens
        for pos in range(start, start + count + lookahead):
            block_id = table[pos // bs]
            assert self.mgr.block_pool.ref_count(block_id) == 1, f"write into shared block {block_id}"
            prefix = tuple(tokens[: pos + 1]) if pos < start + count else (-1,)  # draft slots: garbage
            self.shadow.setdefault(block_id, [None] * bs)[pos % bs] = prefix

    def _allocate(self, rid: str, tokens: list[int], computed: int, new: int, hits: list[int], la: int) -> bool:
        before = snapshot(self.mgr, [*self.reqs, rid])
        ok = self.mgr.allocate_slots(rid, tokens, computed, new, hits, num_lookahead_tokens=la)
        if not ok:
            assert snapshot(self.mgr, [*self.reqs, rid]) == before
        return ok

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        chunk=st.integers(1, 20),
    )
    def new_request(self, base: list[int], cut: int, suffix: list[int], chunk: int) -> None:
        prompt = base[:cut] + suffix or [0]
        bs = self.mgr.block_size
        hits, num_hit = self.mgr.get_computed_blocks(prompt)
        assert num_hit == len(hits) * bs < len(prompt)
        if not self.mgr.enable_prefix_caching:
            assert (hits, num_hit) == ([], 0)
        for i, block_id in enumerate(hits):
            expected = [tuple(prompt[: pos + 1]) for pos in range(i * bs, (i + 1) * bs)]
            assert self.shadow[block_id] == expected, f"hit block {block_id} holds another prefix"
        rid = f"r{self.next_id}"
        self.next_id += 1
        num_new = min(chunk, len(prompt) - num_hit)
        if self._allocate(rid, prompt, num_hit, num_new, hits, 0):
            self.reqs[rid] = ShadowRequest(list(prompt), num_hit)
            self._compute(rid, num_hit, num_new)
            self.reqs[rid].num_computed += num_new

    @precondition(lambda self: self.reqs)
    @rule(
        pick=st.integers(0, 100),
        outputs=st.lists(st.integers(0, 3), min_size=1, max_size=4),
        chunk=st.integers(1, 6),
        lookahead=st.integers(0, 2),
    )
    def step(self, pick: int, outputs: list[int], chunk: int, lookahead: int) -> None:
        rid = self._pick(pick)
        req = self.reqs[rid]
        if req.num_computed == len(req.tokens):  # prefill done: decode the sampled tokens
            req.tokens.extend(outputs)
        num_new = min(chunk, len(req.tokens) - req.num_computed)
        if self._allocate(rid, req.tokens, req.num_computed, num_new, [], lookahead):
            self._compute(rid, req.num_computed, num_new, lookahead)
            req.num_computed += num_new

    @precondition(lambda self: any(r.num_computed > 0 for r in self.reqs.values()))
    @rule(pick=st.integers(0, 100))
    def fork(self, pick: int) -> None:
        src = self._pick(pick)
        req = self.reqs[src]
        if req.num_computed == 0:
            return
        dst = f"r{self.next_id}"
        self.next_id += 1
        shared = self.mgr.fork(src, dst, req.num_computed)
        assert shared == req.num_computed // self.mgr.block_size * self.mgr.block_size
        assert self.mgr.block_table(dst) == self.mgr.block_table(src)[: shared // self.mgr.block_size]
        self.reqs[dst] = ShadowRequest(req.tokens[: req.num_computed], shared)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 100))
    def free(self, pick: int) -> None:
        rid = self._pick(pick)
        del self.reqs[rid]
        self.mgr.free(rid)
        num_free = self.mgr.num_free_blocks
        self.mgr.free(rid)  # a second free is a no-op, never a double release
        assert self.mgr.num_free_blocks == num_free and self.mgr.block_table(rid) == []

    @rule(roll=st.integers(0, 9))  # rarer than the other rules: it undoes everything
    def free_all(self, roll: int) -> None:
        if roll != 7:
            return
        for rid in list(self.reqs):
            self.mgr.free(rid)
        self.reqs.clear()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks and self.mgr.usage == 0.0

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll: int) -> None:
        if roll != 7:
            return
        idle = self.mgr.num_free_blocks == self.mgr.num_blocks
        assert self.mgr.reset_prefix_cache() == idle
        if idle:
            assert self.mgr.block_pool.num_cached_blocks == 0

    @invariant()
    def integrity(self) -> None:
        self.mgr.check_integrity()
        tables = [self.mgr.block_table(rid) for rid in self.reqs]
        in_use = set().union(*tables) if tables else set()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks - len(in_use)
        for rid, req in self.reqs.items():
            assert len(self.mgr.block_table(rid)) >= self.mgr.num_blocks_needed(req.num_computed)

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.mgr.free(rid)
        assert self.mgr.num_free_blocks == self.mgr.num_blocks, "blocks leaked"
        self.mgr.check_integrity()


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase

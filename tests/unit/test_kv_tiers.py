"""The prefix cache's tiers below the pool, in pure Python: exact block ids through eviction, save and load; the disk
tier's files (atomic, checked on read, least recently used out first); and a failing tier turned off in one line."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from tokenmill.kv_cache import DiskTier, KVCacheManager, PrefixTiers, hash_block_tokens

NBYTES = 8  # a block's payload in these tests
LAYOUT = bytes(range(32))


class BytesPool:
    """A KV pool of byte strings (the `BlockIO` the engine's pool is), filled as the step would fill it."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}

    def read_block(self, block_id: int) -> bytes:
        return self.blocks[block_id]

    def write_block(self, block_id: int, data: bytes) -> None:
        self.blocks[block_id] = data


def payload(i: int) -> bytes:
    return bytes([i]) * NBYTES


def chain(tokens: list[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    for i in range(len(tokens) // block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * block_size : (i + 1) * block_size]))
    return hashes


def run_prompt(mgr: KVCacheManager, pool: BytesPool, rid: str, prompt: list[int]) -> int:
    """Admit, move blocks, "compute" the new blocks (their payload: the first token of the block), finish."""
    hit_blocks, num_hit = mgr.get_computed_blocks(prompt)
    assert mgr.allocate_slots(rid, prompt, num_hit, len(prompt) - num_hit, hit_blocks)
    mgr.move_blocks(pool)
    table = mgr.block_table(rid)
    for i in range(num_hit // mgr.block_size, len(table)):
        pool.write_block(table[i], payload(prompt[i * mgr.block_size]))
    mgr.check_integrity()
    mgr.free(rid)
    return num_hit


# ---- the manager over RAM ----


def test_evicted_blocks_are_saved_and_loaded_into_fresh_blocks() -> None:
    mgr, pool = KVCacheManager(num_blocks=4, block_size=2), BytesPool()
    mgr.use_tiers(PrefixTiers(NBYTES, ram_bytes=4 * NBYTES))
    prompt = [1, 2, 3, 4, 5]
    assert run_prompt(mgr, pool, "a", prompt) == 0  # blocks 0, 1 cached; 2 holds the last token
    assert run_prompt(mgr, pool, "b", [9, 9, 8, 8, 7, 7, 6]) == 0  # takes 2, 1, 0, 3: evicts a's blocks
    assert mgr.block_pool.get_cached_block(chain(prompt, 2)[0]) is None
    assert run_prompt(mgr, pool, "c", prompt) == 4
    assert mgr.prefix_cache_hits_by_tier == {"pool": 0, "ram": 4, "disk": 0}
    loaded = [mgr.block_pool.get_cached_block(h) for h in chain(prompt, 2)]  # fresh blocks, registered again
    assert [pool.blocks[b] for b in loaded if b is not None] == [payload(1), payload(3)]
    assert mgr.num_free_blocks == 4
    mgr.check_integrity()


def test_a_pool_hit_comes_first_and_a_tier_hit_follows() -> None:
    mgr, pool = KVCacheManager(num_blocks=6, block_size=2), BytesPool()
    mgr.use_tiers(PrefixTiers(NBYTES, ram_bytes=8 * NBYTES))
    prompt = [1, 2, 3, 4, 5, 6, 7]
    run_prompt(mgr, pool, "a", prompt)  # blocks 0, 1, 2 cached, 3 holds token 7; free queue 4, 5, 3, 2, 1, 0
    run_prompt(mgr, pool, "b", [9] * 7)  # takes 4, 5, 3 (none cached), then 2: a's third block
    hit_blocks, num_hit = mgr.get_computed_blocks(prompt)
    assert (hit_blocks, num_hit) == ([0, 1], 6)  # two in the pool, the third in RAM
    assert mgr.allocate_slots("c", prompt, num_hit, 1, hit_blocks)
    table = mgr.block_table("c")
    mgr.move_blocks(pool)
    assert pool.blocks[table[2]] == payload(5)
    assert mgr.prefix_cache_hits_by_tier == {"pool": 4, "ram": 2, "disk": 0}
    mgr.check_integrity()


def test_saves_write_through_to_disk_and_flush_writes_what_the_pool_holds(tmp_path: Path) -> None:
    mgr, pool = KVCacheManager(num_blocks=4, block_size=2), BytesPool()
    disk = DiskTier(tmp_path, LAYOUT, NBYTES, 100 * NBYTES)
    mgr.use_tiers(PrefixTiers(NBYTES, ram_bytes=4 * NBYTES, disk=disk))
    run_prompt(mgr, pool, "a", [1, 2, 3, 4, 5])
    run_prompt(mgr, pool, "b", [9, 9, 8, 8, 7, 7, 6])  # evicts a's two cached blocks: saved to RAM and disk at once
    a_blocks = chain([1, 2, 3, 4], 2)
    assert all(h in disk for h in a_blocks) and disk.used_bytes == 2 * disk.file_nbytes
    mgr.flush(pool)  # b's three cached blocks, still in the pool
    b_blocks = chain([9, 9, 8, 8, 7, 7], 2)
    assert [disk.get(h) for h in b_blocks] == [payload(9), payload(8), payload(7)]


def test_a_block_evicted_in_this_step_is_not_a_tier_hit_yet() -> None:
    mgr, pool = KVCacheManager(num_blocks=2, block_size=2), BytesPool()
    mgr.use_tiers(PrefixTiers(NBYTES, ram_bytes=4 * NBYTES))
    run_prompt(mgr, pool, "a", [1, 2, 3])  # block 0 cached under [1, 2]
    assert mgr.allocate_slots("b", [5, 5, 5, 5], 0, 4)  # evicts block 0: its save waits for move_blocks
    assert mgr.get_computed_blocks([1, 2, 3]) == ([], 0)
    mgr.move_blocks(pool)
    assert mgr.get_computed_blocks([1, 2, 3]) == ([], 2)
    assert not mgr.allocate_slots("c", [1, 2, 3], 2, 1)  # no room: nothing changes
    mgr.check_integrity()


def test_a_prefix_no_lookup_found_in_a_tier_is_refused() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.use_tiers(PrefixTiers(NBYTES, ram_bytes=4 * NBYTES))
    with pytest.raises(ValueError, match="blocks hold only 0 tokens"):
        mgr.allocate_slots("a", [1, 2, 3], 2, 1)


def test_tiers_need_prefix_caching() -> None:
    with pytest.raises(ValueError, match="need prefix caching"):
        KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False).use_tiers(PrefixTiers(NBYTES, 0))


# ---- RAM over disk ----


def test_ram_spills_its_least_recently_used_blocks_to_disk(tmp_path: Path) -> None:
    tiers = PrefixTiers(NBYTES, ram_bytes=2 * NBYTES, disk=DiskTier(tmp_path, LAYOUT, NBYTES, 100 * NBYTES))
    for h in (1, 2, 3):
        tiers.save(h, payload(h))
    assert tiers.find(1) == ("disk", payload(1))
    assert tiers.find(3) == ("ram", payload(3))
    assert tiers.used_bytes() == {"ram": 2 * NBYTES, "disk": DiskTier(tmp_path, LAYOUT, NBYTES, 1 << 20).used_bytes}
    straight = PrefixTiers(NBYTES, ram_bytes=0, disk=DiskTier(tmp_path / "b", LAYOUT, NBYTES, 100 * NBYTES))
    straight.save(7, payload(7))
    assert straight.find(7) == ("disk", payload(7))


def test_a_failing_disk_is_one_warning_and_ram_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tiers = PrefixTiers(NBYTES, ram_bytes=NBYTES, disk=DiskTier(tmp_path / "d", LAYOUT, NBYTES, 100 * NBYTES))
    shutil.rmtree(tmp_path / "d")  # the folder goes away under a running server: every write now fails
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        for h in (1, 2, 3):
            tiers.save(h, payload(h))
    assert len(caplog.records) == 1 and "going on without it" in caplog.records[0].message
    assert tiers.disk is None and tiers.find(3) == ("ram", payload(3)) and tiers.find(1) is None


# ---- the disk tier's files ----


def test_a_block_file_is_written_whole_and_read_back(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, LAYOUT, NBYTES, 100 * NBYTES)
    disk.put(0xAB, payload(5))
    (path,) = disk.folder.iterdir()
    assert path.name == f"{0xAB:032x}.kvblock" and disk.folder.parent == tmp_path
    assert DiskTier(tmp_path, LAYOUT, NBYTES, 100 * NBYTES).get(0xAB) == payload(5)  # a restart reads it
    assert DiskTier(tmp_path, bytes(32), NBYTES, 100 * NBYTES).get(0xAB) is None  # another layout: another folder
    assert disk.get(0xCD) is None


@pytest.mark.parametrize("damage", ["truncated", "flipped payload", "bad magic", "another block", "empty"])
def test_a_corrupt_file_is_a_miss_deleted_with_one_warning(damage: str, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    disk = DiskTier(tmp_path, LAYOUT, NBYTES, 100 * NBYTES)
    disk.put(1, payload(1))
    disk.put(2, payload(2))
    path = disk.folder / f"{1:032x}.kvblock"
    data = path.read_bytes()
    damaged = {"truncated": data[:-3], "flipped payload": data[:-1] + b"\xff", "bad magic": b"X" + data[1:],
               "another block": (disk.folder / f"{2:032x}.kvblock").read_bytes(), "empty": b""}[damage]  # fmt: skip
    path.write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        assert disk.get(1) is None
    assert len(caplog.records) == 1 and "corrupt" in caplog.records[0].message
    assert not path.exists() and disk.get(2) == payload(2)


def test_least_recently_used_files_go_first_across_restarts(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, LAYOUT, NBYTES, 100 * NBYTES)
    for h in (1, 2, 3):
        disk.put(h, payload(h))
    for age, h in enumerate((2, 3, 1)):  # oldest access first: 2, then 3, then 1
        os.utime(disk.folder / f"{h:032x}.kvblock", (1000 + age, 1000 + age))
    (disk.folder / ".stale.123.tmp").write_bytes(b"half a block")
    os.utime(disk.folder / ".stale.123.tmp", (1000, 1000))
    small = DiskTier(tmp_path, LAYOUT, NBYTES, 2 * disk.file_nbytes)  # a restart with room for two
    assert sorted(p.name[:32] for p in small.folder.glob("*.kvblock")) == [f"{1:032x}", f"{3:032x}"]
    assert not list(small.folder.glob("*.tmp"))
    assert small.get(3) == payload(3)  # now 1 is the least recently used
    small.put(4, payload(4))
    assert small.get(1) is None and small.get(3) == payload(3) and small.get(4) == payload(4)


def test_an_unwritable_folder_raises_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        DiskTier(blocker / "cache", LAYOUT, NBYTES, 100 * NBYTES)


@pytest.mark.parametrize("seed", range(4))
def test_every_hit_block_holds_its_own_prefix_under_random_traffic(seed: int, tmp_path: Path) -> None:
    """Prompts from a small alphabet over a small pool, RAM for two blocks and disk for twelve: after each
    lookup and `move_blocks`, every block counted as computed holds the payload of its own chained hash."""
    import random

    rng = random.Random(seed)
    mgr, pool = KVCacheManager(num_blocks=8, block_size=2), BytesPool()
    disk = DiskTier(tmp_path, LAYOUT, NBYTES, 1)
    disk.capacity_bytes = 12 * disk.file_nbytes  # twelve blocks on disk, two in RAM
    mgr.use_tiers(PrefixTiers(NBYTES, ram_bytes=2 * NBYTES, disk=disk))

    def own(block_hash: int) -> bytes:
        return block_hash.to_bytes(16, "little")[:NBYTES]

    running: list[str] = []
    for step in range(200):
        if running and (rng.random() < 0.4 or len(running) > 2):
            mgr.free(running.pop(rng.randrange(len(running))))
            continue
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        hit_blocks, num_hit = mgr.get_computed_blocks(prompt)
        if not mgr.allocate_slots(f"r{step}", prompt, num_hit, len(prompt) - num_hit, hit_blocks):
            mgr.move_blocks(pool)
            continue
        mgr.move_blocks(pool)
        table, hashes = mgr.block_table(f"r{step}"), chain(prompt, 2)
        assert [pool.blocks[b] for b in table[: num_hit // 2]] == [own(h) for h in hashes[: num_hit // 2]]
        for i in range(num_hit // 2, len(table)):  # the step computes the rest
            pool.write_block(table[i], own(hashes[i]) if i < len(hashes) else b"partial!")
        running.append(f"r{step}")
        mgr.check_integrity()
    assert all(mgr.prefix_cache_hits_by_tier.values()), mgr.prefix_cache_hits_by_tier

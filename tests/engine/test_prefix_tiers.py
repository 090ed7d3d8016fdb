"""The prefix cache's RAM and disk tiers: blocks the pool evicts come back for a prompt that starts alike, with the
tokens the pool itself would give; the disk tier survives a restart; a corrupt file or an unusable folder costs a
recompute and one warning line, never a wrong token; and every block is back in the pool afterwards."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core import EngineCore
from tokenmill.kv_cache import hash_block_tokens

BLOCK = 4
_RNG = random.Random(7)
PREFIX = [_RNG.randrange(3, 380) for _ in range(41)]  # 10 full blocks of 4; a hit covers (41 - 1) // 4 = 10
FILLERS = [[_RNG.randrange(3, 380) for _ in range(40)] for _ in range(2)]  # together they evict the prefix's blocks
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HIT_TOKENS = (len(PREFIX) - 1) // BLOCK * BLOCK
BLOCK_NBYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x (k, v) x tokens x kv heads x head dim x float32


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", initializer_range=0.1)


def _llm(folder: Path, dtype: str = "float32", **kwargs: Any) -> LLM:
    return LLM(str(folder), dtype=dtype, device=target.DEVICE, block_size=BLOCK, **kwargs)


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return list(llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0].outputs[0].token_ids)


def _prefix_again(llm: LLM) -> list[int]:
    """The prefix, then prompts that push its blocks out of a small pool, then the prefix again: its tokens."""
    _tokens(llm, PREFIX)
    for filler in FILLERS:
        _tokens(llm, filler)
    return _tokens(llm, PREFIX)


def _hits(llm: LLM) -> dict[str, int]:
    return dict(llm.engine.kv.prefix_cache_hits_by_tier)


def assert_pool_full(engine: EngineCore) -> None:
    assert not engine.has_unfinished()
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def expected(folder: Path, dtype: str) -> list[int]:
    """The prefix's tokens after a hit on its blocks in a pool large enough to keep them."""
    llm = _llm(folder, dtype)
    tokens = _prefix_again(llm)
    assert _hits(llm)["pool"] == HIT_TOKENS
    if dtype == "float32":  # a hit gives the tokens of a fresh run
        assert tokens == _tokens(_llm(folder, dtype, enable_prefix_caching=False), PREFIX)
    return tokens


def test_evicted_blocks_come_back_from_ram_with_the_same_tokens(folder: Path, dtype: str, expected: list[int]) -> None:
    llm = _llm(folder, dtype, num_kv_blocks=14, prefix_cache_ram_gb=0.01)
    assert _prefix_again(llm) == expected
    hits = _hits(llm)
    assert hits["ram"] > 0 and hits["pool"] + hits["ram"] == HIT_TOKENS and hits["disk"] == 0
    snap = llm.engine.snapshot()
    assert snap.prefix_cache_ram_hits == hits["ram"] and snap.prefix_cache_ram_bytes > 0
    assert_pool_full(llm.engine)


def test_ram_spills_to_disk_and_the_disk_survives_a_restart(folder: Path, expected: list[int], dtype: str,
                                                            tmp_path: Path) -> None:  # fmt: skip
    ram_gb = 3 * BLOCK_NBYTES / 2**30  # three float32 blocks (six in bfloat16): the rest spill to disk
    llm = _llm(folder, dtype, num_kv_blocks=14, prefix_cache_ram_gb=ram_gb, prefix_cache_dir=str(tmp_path))
    assert _prefix_again(llm) == expected
    hits = _hits(llm)
    assert hits["disk"] > 0 and sum(hits.values()) == HIT_TOKENS
    assert_pool_full(llm.engine)

    restarted = _llm(folder, dtype, num_kv_blocks=14, prefix_cache_dir=str(tmp_path))
    assert _tokens(restarted, PREFIX) == expected
    assert _hits(restarted) == {"pool": 0, "ram": 0, "disk": HIT_TOKENS}
    assert_pool_full(restarted.engine)


def test_a_restart_finds_the_blocks_the_pool_held_at_shutdown(folder: Path, tmp_path: Path) -> None:
    llm = _llm(folder, prefix_cache_dir=str(tmp_path))  # a pool that evicts nothing: the disk gets blocks at close
    first = _tokens(llm, PREFIX)
    assert not list(tmp_path.rglob("*.kvblock"))
    llm.close()
    restarted = _llm(folder, prefix_cache_dir=str(tmp_path))
    assert _tokens(restarted, PREFIX) == first
    assert _hits(restarted) == {"pool": 0, "ram": 0, "disk": HIT_TOKENS}
    assert_pool_full(restarted.engine)


def test_a_changed_setting_reads_no_stale_block(folder: Path, tmp_path: Path) -> None:
    """Another dtype (another layout of bytes) is another folder: no hit, no error."""
    _prefix_again(_llm(folder, "float32", num_kv_blocks=14, prefix_cache_dir=str(tmp_path)))
    other = _llm(folder, "bfloat16", num_kv_blocks=14, prefix_cache_dir=str(tmp_path))
    _tokens(other, PREFIX)
    assert _hits(other)["disk"] == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_a_corrupt_block_file_is_one_warning_and_a_recompute(folder: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    fresh = _tokens(_llm(folder, enable_prefix_caching=False), PREFIX)
    _prefix_again(_llm(folder, num_kv_blocks=14, prefix_cache_dir=str(tmp_path)))
    # the prefix's third block: the first two still load, the rest is recomputed
    h = hash_block_tokens(None, PREFIX[:BLOCK])
    h = hash_block_tokens(h, PREFIX[BLOCK : 2 * BLOCK])
    h = hash_block_tokens(h, PREFIX[2 * BLOCK : 3 * BLOCK])
    (path,) = tmp_path.glob(f"*/{h:032x}.kvblock")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = _llm(folder, num_kv_blocks=14, prefix_cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        assert _tokens(restarted, PREFIX) == fresh
    assert len([r for r in caplog.records if "corrupt" in r.message]) == 1
    assert _hits(restarted)["disk"] == 2 * BLOCK
    assert not path.exists()  # deleted; its block is in the pool again, recomputed
    assert_pool_full(restarted.engine)


def test_an_unusable_folder_is_one_warning_and_serving_goes_on(folder: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    fresh = _tokens(_llm(folder, enable_prefix_caching=False), PREFIX)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        llm = _llm(folder, num_kv_blocks=14, prefix_cache_dir=str(blocker / "cache"))
    assert len([r for r in caplog.records if "cannot be used" in r.message]) == 1
    assert llm.engine.kv.tiers is None
    assert _prefix_again(llm) == fresh
    assert _hits(llm)["disk"] == 0
    assert_pool_full(llm.engine)


@pytest.mark.parametrize("arch, overrides", [("mistral", dict(sliding_window=8)),
                                             ("gemma3", dict(head_dim=16, sliding_window=8))])  # fmt: skip
def test_a_windowed_model_loads_its_blocks_back_with_the_same_tokens(
    make_checkpoint: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    """Every layer's keys and values stay in the pool while the sequence runs, windowed or not (blocks before the window
    are not freed early), so a block from a tier is the block the pool held."""
    windowed = make_checkpoint(arch, initializer_range=0.1, **overrides)
    fresh = _tokens(_llm(windowed, enable_prefix_caching=False), PREFIX)
    assert _prefix_again(_llm(windowed)) == fresh
    llm = _llm(windowed, num_kv_blocks=14, prefix_cache_ram_gb=0.01)
    assert _prefix_again(llm) == fresh
    assert _hits(llm)["ram"] > 0
    assert_pool_full(llm.engine)

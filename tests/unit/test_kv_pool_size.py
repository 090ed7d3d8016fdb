"""The paged KV pool's size (attention/sizing.py): pure arithmetic from the configs, with the RAM probe and the
GPU's free memory replaced, so no result depends on this machine's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill.attention import sizing
from tokenmill.attention.paged import PagedKVCache
from tokenmill.attention.sizing import DEFAULT_CONTEXT_TOKENS, blocks_for, plan_num_blocks
from tokenmill.config import EngineConfig
from tokenmill.model_config import ModelConfig

DEMO = Path(sizing.__file__).resolve().parents[1] / "assets" / "demo" / "config.json"
CPU, F32 = torch.device("cpu"), torch.float32
PLENTY = 2**50  # bytes of RAM: the cap is 4 GiB


def demo(**overrides: object) -> ModelConfig:
    return ModelConfig.from_hf({**json.loads(DEMO.read_text()), **overrides})


def per_block(model: ModelConfig, block_size: int = 16, dtype: torch.dtype = F32) -> int:
    return PagedKVCache.bytes_per_block(model.num_layers, block_size, model.num_kv_heads, model.head_dim, dtype)


@pytest.fixture
def ram(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The available RAM the CPU cap sees: ram[0] bytes (plenty unless a test sets it)."""
    box = [PLENTY]
    monkeypatch.setattr(sizing, "available_memory", lambda: box[0])
    return box


def plan(model: ModelConfig, **engine: object) -> int:
    """The CPU pool's blocks; the resolved max_model_len is the given one or the model's, as the loader's is."""
    cfg = EngineConfig(**engine)
    return plan_num_blocks(model, cfg, F32, CPU, cfg.max_model_len or model.max_position_embeddings)


def test_max_model_len_times_max_num_seqs(ram: list[int]) -> None:
    """A tiny model asked for 4 sequences of 512 tokens reserves exactly their blocks."""
    assert plan(demo(), max_model_len=512, max_num_seqs=4) == 4 * 512 // 16
    assert plan(demo(), max_model_len=500, max_num_seqs=3, block_size=32) == 3 * 16  # whole blocks each
    assert plan(demo(), max_model_len=2048, max_num_seqs=64) == 64 * 2048 // 16  # asked for: more than the default


def test_without_max_model_len_the_default_total_context(ram: list[int]) -> None:
    """No --max-model-len: the model's trained context, at least DEFAULT_CONTEXT_TOKENS, at most max_num_seqs
    full-length sequences."""
    model = demo()  # trained context 2048
    assert plan(model) == DEFAULT_CONTEXT_TOKENS // 16
    assert plan(model, max_num_seqs=4) == 4 * 2048 // 16  # what 4 sequences can use, no more
    assert plan(model, max_num_seqs=1) == 2048 // 16  # one max-length request
    long = demo(max_position_embeddings=100_000)
    assert plan(long) == blocks_for(100_000, 16)  # the trained context, when it is longer


def test_the_cap_applies(ram: list[int]) -> None:
    model = demo(num_hidden_layers=64, num_key_value_heads=4)  # 64 KiB a token in float32: 2 MiB per full block
    assert plan(model, max_model_len=2048, max_num_seqs=64) == 4 * 2**30 // per_block(model)  # 4 GiB
    ram[0] = 800 * per_block(demo())  # a quarter of it: 200 blocks
    assert plan(demo(), max_model_len=2048, max_num_seqs=64) == 200
    assert plan(demo()) == 200
    assert plan(demo(), max_model_len=512, max_num_seqs=4) == 4 * 32  # under the cap: what was asked
    ram[0] = 0
    assert plan(demo(), max_model_len=512) == 1  # never an empty pool


def test_explicit_options_win(ram: list[int]) -> None:
    ram[0] = 4 * per_block(demo())  # a cap of one block: neither option heeds it
    assert plan(demo(), num_kv_blocks=7) == 7
    assert plan(demo(), num_kv_blocks=7, kv_cache_memory_gb=1.0, max_model_len=512) == 7
    gb = 0.5
    assert plan(demo(), kv_cache_memory_gb=gb, max_num_seqs=1) == int(gb * 2**30 // per_block(demo()))


def test_gpu_keeps_its_share_of_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: 80% of the free memory, at most max_num_seqs full-length sequences, with --max-model-len or not."""
    free = [100 * per_block(demo())]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 10 * free[0]))
    cuda = torch.device("cuda")
    for engine in ({}, {"max_model_len": 2048}):
        assert plan_num_blocks(demo(), EngineConfig(**engine), F32, cuda, 2048) == 80
    free[0] = 2**50
    assert plan_num_blocks(demo(), EngineConfig(max_num_seqs=3), F32, cuda, 2048) == 3 * 128


def test_the_cli_help_states_the_default_context() -> None:
    from tokenmill.engine_flags import HELP

    assert f"at least {DEFAULT_CONTEXT_TOKENS} tokens" in HELP["max_model_len"]

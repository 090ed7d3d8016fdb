"""The default CPU KV pool of a real engine follows --max-model-len x --max-num-seqs (attention/sizing.py), the
start-up line reports it, and a request that cannot fit under the RAM cap still gets the clear error. The RAM
probe is replaced, so nothing depends on this machine's memory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import PagedKVCache, sizing
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.model_config import ModelConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1)  # trained context 512


def pool(llm: LLM) -> PagedKVCache:
    kv = llm.engine.runner.kv
    assert isinstance(kv, PagedKVCache)
    return kv


def test_default_pool_follows_max_model_len(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "available_memory", lambda: 2**40)  # the 4 GiB cap: far above these pools
    for max_model_len, max_num_seqs in ((128, 3), (256, 3), (256, 5)):
        llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        blocks = max_num_seqs * max_model_len // 16
        assert llm.engine.kv is not None and llm.engine.kv.num_blocks == blocks
        assert pool(llm).num_blocks == blocks
        reserved = round(pool(llm).cache.nbytes / 2**20)
        line = AsyncEngine(llm.engine, llm.loaded).description
        assert f"KV capacity {blocks * 16} tokens ({blocks} blocks)" in line
        assert f"KV pool {reserved} MiB reserved" in line
        assert llm.generate(["Hello world!"] * max_num_seqs, GREEDY)[0].outputs[0].token_ids


def test_a_request_past_the_capped_pool_gets_the_clear_error(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    per_block = PagedKVCache.bytes_per_block(model.num_layers, 16, model.num_kv_heads, model.head_dim, torch.float32)
    monkeypatch.setattr(sizing, "available_memory", lambda: 4 * 6 * per_block)  # a quarter: 6 blocks
    small = LLM(str(folder), dtype="float32", device="cpu")
    assert pool(small).num_blocks == 6 and pool(small).num_blocks * 16 < small.engine.max_model_len
    with pytest.raises(ValueError, match=r"needs \d+ KV blocks .* but the whole pool has 6; lower max_tokens"):
        small.generate("Hello world!", SamplingParams(max_tokens=200))
    assert small.generate("Hello world!", GREEDY)[0].outputs[0].token_ids  # what fits still runs

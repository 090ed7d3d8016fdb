"""Sliding-window attention in every KV backend: a windowed model's greedy tokens equal `transformers.generate`
alone, and stay the same batched, with chunked prefill, a prefix-cache hit, preemption, without the fused
kernels, and with the contiguous and no-cache backends. Prompts and outputs run well past the window."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import target
from tokenmill import LLM, SamplingParams

WINDOW = 8
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    # Gemma 3: sliding layers between global ones, each kind with its RoPE
    "gemma3": (
        "gemma3",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}
rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 13, 30, 41)]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def windowed(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]) -> tuple[Path, list[list[int]]]:
    """The checkpoint, and transformers' greedy tokens for each prompt alone."""
    from transformers import AutoModelForCausalLM

    arch, overrides = CHECKPOINTS[request.param]
    folder = make_checkpoint(arch, initializer_range=0.1, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(target.DEVICE).eval()
    want = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = hf.generate(target.ids_tensor([ids]), max_new_tokens=PARAMS.max_tokens,
                              min_new_tokens=PARAMS.max_tokens, do_sample=False)  # fmt: skip
            want.append(out[0, len(ids) :].tolist())
    return folder, want


def _run(folder: Path, **engine: Any) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    assert llm.engine.kv is None or llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine",
    [
        {},  # batched, fused decode attention
        {"cpu_kernels": False},  # the SDPA decode path with its window bias
        {"max_num_batched_tokens": 8, "block_size": 4},  # chunks shorter than the window, blocks inside it
        {"num_kv_blocks": 18, "block_size": 4},  # preemption by recompute
        {"kv_cache": "contiguous"},
        {"kv_cache": "none", "enable_prefix_caching": False},
        {"speculative_model": "ngram", "num_speculative_tokens": 3},  # drafts verified as decode rows
    ],
    ids=["batched", "no-kernels", "chunked", "preempted", "contiguous", "no-cache", "speculative"],
)
def test_windowed_greedy_equals_transformers(windowed: tuple[Path, list[list[int]]], engine: dict[str, Any]) -> None:
    folder, want = windowed
    assert _run(folder, **engine) == want


def test_a_prefix_cache_hit_past_the_window(windowed: tuple[Path, list[list[int]]]) -> None:
    folder, want = windowed
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE, block_size=4)
    first = llm.generate([{"prompt_token_ids": PROMPTS[3]}], PARAMS)[0]
    again = llm.generate([{"prompt_token_ids": PROMPTS[3]}], PARAMS)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want[3]
    assert again.metrics is not None and again.metrics.num_cached_tokens >= 32  # most of the prompt, from cache

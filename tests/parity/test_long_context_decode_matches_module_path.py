"""The decode stack's attention over contexts longer than one split (kernels/csrc/attention/decode.h): a sequence alone
runs its splits as separate tasks, each roping its own copy of the queries, the split that holds the new token also
writing its key and value, and the last split to finish merging them (one that crosses from one split into two
while it decodes included); in a batch the RoPE stage goes first. Qwen3's q/k norms go with the RoPE. Each gives
the module path's tokens and logprobs, whose attention takes the same splits in one call."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.parity.test_models import SPREAD, _skip_without_stack
from tokenmill import LLM, SamplingParams


# mistral with a window of 150 positions: a row's window spans two splits of its three (the stack's tasks are the
# whole context's splits, those past the window's empty), and a short row's window is all of it
@pytest.mark.parametrize("arch, overrides", [("qwen2", {}), ("qwen3", {}), ("mistral", dict(sliding_window=150))])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 0.05)])
def test_contexts_of_several_splits_match_the_module_path_alone_and_batched(
    make_checkpoint: Callable[..., Path], arch: str, overrides: dict[str, Any], dtype: str, tol: float
) -> None:
    # head_dim 32: AVX-512 BF16's attention path where the CPU has it (the portable one otherwise)
    folder = make_checkpoint(arch, **SPREAD, hidden_size=128, num_attention_heads=4, head_dim=32, **overrides)
    llm = LLM(str(folder), dtype=dtype, device="cpu", enable_prefix_caching=False)
    _skip_without_stack(llm)
    split = int(llm.loaded.ops.module.attention_split)  # type: ignore[union-attr]
    rng = random.Random(0)
    long = [rng.randrange(3, 384) for _ in range(2 * split + 9)]  # three splits
    short = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, split - 2)]  # the second crosses into two
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(prompts: list[list[int]]) -> list[Any]:
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]

    def runs() -> list[Any]:  # each long-ish prompt alone (one row: its splits as tasks), then all three at once
        return run([long]) + run([short[1]]) + run([short[0], long, short[1]])

    runner = llm.engine.runner
    stacked = runs()
    stack, runner.decode_stack = runner.decode_stack, None
    modules = runs()
    runner.decode_stack = stack
    assert stacked[0].token_ids == stacked[3].token_ids and stacked[1].token_ids == stacked[4].token_ids
    for a, b in zip(stacked, modules, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la) < tol

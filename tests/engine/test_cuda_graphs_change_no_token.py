"""Decode steps through CUDA graph buckets (cuda_graphs.py) change no token and leak no block.

On a GPU (`--device cuda`) the engine records the graphs itself, and `--enforce-eager` is the reference. On the
CPU the same buckets run eagerly (what a graph would record: padded rows, the spare block, tables cut to a
power-of-two width), attached to an engine on the pure-torch path, whose paged pool has the spare block.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.cuda_graphs import DecodeGraphs

rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 384) for _ in range(rng.randrange(1, 70))] for _ in range(13)]
PARAMS = [SamplingParams(temperature=0, max_tokens=3 + 5 * i, ignore_eos=True) for i in range(13)]  # the batch shrinks


def _llm(folder: Path, **kwargs: Any) -> LLM:
    return LLM(str(folder), dtype="float32", device=target.DEVICE, cpu_kernels=False, block_size=8, **kwargs)


def _graphs(llm: LLM) -> DecodeGraphs:
    runner = llm.engine.runner
    if runner.graphs is None:  # the CPU: the buckets, run eagerly
        assert target.DEVICE == "cpu"
        runner.graphs = DecodeGraphs(llm.loaded.model, runner.kv, llm.engine.scheduler.config.max_num_seqs,
                                     llm.engine.max_model_len, record=False)  # fmt: skip
    return runner.graphs


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("gemma3", dict(head_dim=16, sliding_window=8))])
def test_graph_buckets_change_no_greedy_token(
    make_checkpoint: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    folder = make_checkpoint(arch, initializer_range=0.1, **overrides)
    eager = _llm(folder, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    llm = _llm(folder, max_num_seqs=10)  # buckets of 1, 2, 4, 8 and 10 rows
    graphs = _graphs(llm)
    assert graphs.batch_buckets == [1, 2, 4, 8, 10]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    assert got == want
    rows = {r for r, _ in graphs.buckets}
    assert {1, 10} <= rows and len(rows) >= 4  # full and padded buckets both ran
    assert all(w & (w - 1) == 0 for _, w in graphs.buckets)  # widths in blocks: powers of two
    if target.DEVICE != "cpu":
        assert all(b.graph is not None for b in graphs.buckets.values())
    kv = llm.engine.kv
    kv.check_integrity()
    assert not llm.engine.has_unfinished() and kv.num_free_blocks == kv.num_blocks


def test_padded_rows_write_only_the_spare_block(make_checkpoint: Callable[..., Path]) -> None:
    """Steps of 3 sequences (the 4-row bucket), then 2 and 1, leave the pool, outside its spare block, as eager
    steps leave it: padded rows write nowhere else."""
    import torch

    folder = make_checkpoint("llama", initializer_range=0.1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 5, 7)]
    pools = []
    for eager in (True, False):
        llm = _llm(folder, enforce_eager=eager)
        if not eager:
            graphs = _graphs(llm)
        llm.generate(prompts, params)
        paged = llm.engine.runner.kv
        used = paged._zeroed_below * paged.block_size  # type: ignore[attr-defined]  # the blocks any table held
        assert paged.spare_slot is not None and 0 < used <= paged.spare_slot  # type: ignore[attr-defined]
        pools.append(paged.cache[:, :, :used].clone())  # type: ignore[attr-defined]
    assert {r for r, _ in graphs.buckets} == {1, 2, 4}  # 3 rows padded to 4, then 2, then 1
    assert pools[0].abs().sum() > 0
    # same slots written, same values up to rounding: a GEMM over 4 rows may round apart from one over 3 (MKL's
    # on the CPU, 8e-7 here); a padded row's write anywhere but the spare block would differ by ~1
    torch.testing.assert_close(pools[0], pools[1], rtol=1e-4, atol=1e-5)


def test_a_graph_that_cannot_be_recorded_falls_back_to_eager_steps(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Recording fails (an op CUDA cannot record, or no memory for the graph): one warning, the step and every
    later one run eagerly, and no request is lost or changed."""
    folder = make_checkpoint("llama", initializer_range=0.1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    want = [o.outputs[0].token_ids for o in _llm(folder, enforce_eager=True).generate(prompts, PARAMS[:5])]
    llm = _llm(folder)
    graphs = _graphs(llm)
    graphs.record = True
    calls = []

    def refuse(*args: Any) -> None:
        calls.append(args)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_record", refuse)
    with caplog.at_level("WARNING", logger="tokenmill.engine"):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS[:5])]
    assert got == want
    assert len(calls) == 1 and not graphs.record  # tried once, then eager
    assert sum("recording a CUDA graph failed" in r.getMessage() for r in caplog.records) == 1
    assert graphs.buckets and all(b.graph is None for b in graphs.buckets.values())
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished() and kv.num_free_blocks == kv.num_blocks


def test_a_one_token_prompt_chunk_with_prompt_logprobs_takes_no_graph(make_checkpoint: Callable[..., Path]) -> None:
    """A budget of 2 tokens a step cuts a prompt into one-token chunks beside another's decode: such a step has one
    new token per sequence, as a graph's does, but its prompt logprobs need the hidden states a graph does not
    give. It runs eagerly, with the prompt logprobs of an engine without graphs."""
    folder = make_checkpoint("llama")
    params = [
        SamplingParams(temperature=0, max_tokens=2),
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
    ]
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 30))}]
    want = _llm(folder, max_num_batched_tokens=2).generate(prompts, params)
    llm = _llm(folder, max_num_batched_tokens=2)
    _graphs(llm)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].finish_reason for o in got] == ["length", "length"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got[1].prompt_logprobs or [], want[1].prompt_logprobs or [], strict=True):
        assert (g is None) == (w is None) and (g is None or g.keys() == w.keys())

"""Tensor parallelism on CPU (gloo, 2 processes): the same greedy tokens and float32 logprobs within 1e-4 as
one process, for every family; KV heads replicated when there are fewer than ranks; each rank holds
its shard only; a killed rank is an error within seconds, never a hang; what it cannot shard is refused."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.tensor_parallel.shm import ShmAllReduce
from tokenmill.tensor_parallel.workers import TensorParallelError, worker_pids

PROMPTS = ["hello world", "the quick brown fox jumps", "a"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5)


def _outputs(llm: LLM) -> list[Any]:
    return llm.generate(PROMPTS, GREEDY)


def _same(want: list[Any], got: list[Any]) -> None:
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        pairs = list(zip(w.outputs[0].logprobs, g.outputs[0].logprobs)) + list(zip(w.prompt_logprobs[1:],
                                                                                  g.prompt_logprobs[1:]))  # fmt: skip
        for a, b in pairs:
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 8}),
        ("llama", {"num_key_value_heads": 1}),
        ("llama", {"vocab_size": 385}),  # the head's rows split unevenly (193 + 192, padded)
        ("phi3", {}),
        ("gpt2", {}),
        ("gemma3", {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
        # each expert's rows split (a dense second layer beside them), one all-reduce per MoE layer
        (
            "qwen3_moe",
            {
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "norm_topk_prob": True,
                "mlp_only_layers": [1],
            },
        ),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
    ids=[
        "llama",
        "qwen2",
        "qwen3",
        "mistral-window",
        "kv-replicated",
        "odd-vocab",
        "phi3",
        "gpt2",
        "gemma3",
        "qwen3-moe",
        "mixtral",
    ],
)
def test_two_ranks_compute_what_one_does(
    make_checkpoint: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    folder = str(make_checkpoint(arch, initializer_range=0.1, **overrides))
    one = LLM(folder, dtype="float32", threads=1)
    want = _outputs(one)
    two = LLM(folder, dtype="float32", threads=1, tensor_parallel_size=2)
    try:
        assert len(worker_pids(two.engine.runner)) == 1
        _same(want, _outputs(two))
        # rank 0 holds its shard of every layer's weights: about half (norms, and replicated KV heads, are whole)
        assert _layer_bytes(two) < 0.6 * _layer_bytes(one)
        head = two.loaded.model.lm_head  # vocab-parallel: this rank's rows of it
        assert head.vocab_size == one.loaded.config.vocab_size and head.size == 2
        kv = two.engine.kv
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        two.close()


def _layer_bytes(llm: LLM) -> int:
    state = llm.loaded.model.state_dict()
    return sum(t.numel() * t.element_size() for name, t in state.items() if ".layers." in name or ".h." in name)


def test_a_killed_rank_is_an_error_within_seconds(make_checkpoint: Callable[..., Path]) -> None:
    llm = LLM(str(make_checkpoint("qwen2", initializer_range=0.1)), dtype="float32", threads=1,
              tensor_parallel_size=2)  # fmt: skip
    try:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
        (pid,) = worker_pids(llm.engine.runner)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError):
            llm.generate(PROMPTS, SamplingParams(max_tokens=8))
        assert time.monotonic() - start < 10
    finally:
        llm.close()


def test_what_cannot_be_sharded_is_refused(make_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError, match="does not divide this model"):
        LLM(str(make_checkpoint("llama", initializer_range=0.1)), dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="drop speculative_model"):
        LLM(str(make_checkpoint("llama", initializer_range=0.1)), tensor_parallel_size=2, speculative_model="ngram")


def _shm_rank(rank: int, port: int, results: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from tokenmill.tensor_parallel.shm import MAX_ELEMS, ShmAllReduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    name = [ShmAllReduce.new_name()]
    dist.broadcast_object_list(name, src=0)
    reduce = ShmAllReduce(rank, 2, name[0])
    sums = []
    for step, n in enumerate([7, 896, 3, MAX_ELEMS, MAX_ELEMS + 5, 12]):  # the last-but-one takes gloo's path
        x = torch.arange(n, dtype=torch.float32) * (rank + 1) + step
        reduce(x)
        sums.append(x.tolist()[:5] + [float(x.sum())])
    results[rank] = sums
    dist.destroy_process_group()


@pytest.mark.skipif(not ShmAllReduce.supported(),
                    reason="the shared-memory all-reduce runs on x86 only; other CPUs keep gloo's")  # fmt: skip
def test_the_shared_memory_all_reduce_sums_like_gloo() -> None:
    import multiprocessing as mp

    from tests.server.helpers import free_port
    from tokenmill.tensor_parallel.shm import MAX_ELEMS

    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_shm_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert results[0] == results[1]  # every rank holds the same sums
    for step, n in enumerate([7, 896, 3, MAX_ELEMS, MAX_ELEMS + 5, 12]):
        want = [3 * i + 2 * step for i in range(min(n, 5))] + [3 * n * (n - 1) / 2 + 2 * step * n]
        assert results[0][step] == pytest.approx(want, rel=1e-6)

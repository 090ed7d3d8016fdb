"""bench/flops.py's arithmetic on given numbers: a run's model GFLOPS and its share of each peak (no probe runs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.bench.flops import (
    Peak,
    flops_summary,
    fma_share,
    matmul_params,
    model_flops,
    peak_shares,
    report_rows,
)

FMA = Peak("vfmadd231ps ymm", "float32", 100.0, 2)
VNNI = Peak("vpdpbusd ymm", "int8 products into int32", 400.0, 2)


def test_model_flops_counts_layers_per_token_through_them_and_the_head_per_generated_token() -> None:
    # 2 requests of 10 prompt + 4 generated tokens: 20 + 8 - 2 = 26 tokens through the layers, 8 through the head
    assert model_flops(1000, 100, 20, 8, 2) == 2 * (1000 * 26 + 100 * 8)
    assert model_flops(1000, 100, 0, 0, 0) == 0
    assert model_flops(1000, 100, 5, 1, 1) == 2 * (1000 * 5 + 100 * 1)  # one token: the prefill alone
    with pytest.raises(ValueError):
        model_flops(-1, 0, 1, 1, 1)


def test_shares_are_the_run_over_each_peak() -> None:
    assert peak_shares(50.0, [FMA, VNNI]) == [(FMA, 0.5), (VNNI, 0.125)]
    assert peak_shares(50.0, [Peak("x", "float32", 0.0, 1)]) == []  # a failed probe is no peak


def test_a_runs_summary_and_its_report_rows() -> None:
    # 4e9 operations in 2 s: 2 GFLOPS (1e9 x 2 x (layers 1e6 x 2000 tokens), head 0)
    s = flops_summary(10**6, 0, 1000, 1004, 4, 2.0, [FMA, VNNI])
    assert s["model_gflops"] == pytest.approx(2.0)
    assert [p["share"] for p in s["peaks"]] == pytest.approx([0.02, 0.005])
    assert s["matmul_params"] == {"body": 10**6, "head": 0}
    rows = report_rows(s)
    assert rows[0] == "| model GFLOPS (linears; formula below) | 2.0 |"
    assert rows[1] == "| share of the vfmadd231ps ymm peak (100 GFLOPS, 2 threads) | 2% |"
    assert rows[2] == "| share of the vpdpbusd ymm peak (400 GOPS, 2 threads) | 0% |"
    assert fma_share(s) == "2.0 (2% of vfmadd231ps ymm)"
    assert fma_share(flops_summary(10**6, 0, 1000, 1004, 4, 2.0, [])) == "2.0"


def test_matmul_params_from_the_config(make_checkpoint: Callable[..., Path]) -> None:
    """The tiny qwen2 (hidden 64, MLP 96, 2 layers, 4 heads of 16, 2 KV heads, vocab 384): each layer's q, k, v, o and
    gate, up, down; the head vocab x hidden, tied or not."""
    hidden, inter, layers, q, kv, vocab = 64, 96, 2, 4 * 16, 2 * 16, 384
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    for tie in (False, True):
        folder = make_checkpoint("qwen2", tie_word_embeddings=tie)
        assert matmul_params(str(folder)) == (layers * per_layer, vocab * hidden)

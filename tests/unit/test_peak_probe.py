"""The arithmetic peak probe (kernels/csrc/ops/peak.h, bench/flops.py) on every kernel variant this CPU runs: the
operations it reports are the operations its accumulators hold, and the Python probe gives a positive finite rate.

With every operand 1 and every sum starting at 0, each multiply-add adds exactly 1 to its accumulator, so the sum of
all accumulators (the checksum) is the number of multiply-adds done: half the operations reported. The counts are
small enough to be exact (float32 sums below 2^24). No speed is asserted: the machine may be shared."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import kernels
from tokenmill.bench import flops

ITERS = (1000, 3000)


def _per_round(ops: kernels.Kernels, kind: int, instruction: str) -> int:
    """Operations one thread's round does, from the instruction's width and what it multiplies (ops/peak.h)."""
    chains = int(ops.module.peak_chains)
    int32_lanes = 16 if "zmm" in instruction else 8
    return {
        0: chains * ops.lanes * 2,  # FMA: a multiply-add a float lane
        1: chains * 16 * 2 * 2,  # vdpbf16ps zmm: 2 bf16 products a float lane
        2: chains * int32_lanes * 4 * 2,  # vpdpbusd: 4 int8 products an int32 lane
        3: 4 * 16 * 16 * 32 * 2,  # tdpbf16ps: 4 tiles of 16 x 16 sums, 32 products each
        4: 4 * 16 * 16 * 64 * 2,  # tdpbusd: 64 products each
    }[kind]


def test_every_variant_has_the_fma_peak_named_by_its_instruction(ops: kernels.Kernels) -> None:
    kinds = {kind: name for kind, name, _ in ops.module.peak_kinds()}
    assert 0 in kinds
    expected = {"avx2": "vfmadd231ps ymm", "avxvnni": "vfmadd231ps ymm", "avx512": "vfmadd231ps zmm",
                "avx512vnni": "vfmadd231ps zmm", "avx512bf16": "vfmadd231ps zmm"}.get(ops.level)  # fmt: skip
    if expected:
        assert kinds[0] == expected
    assert (2 in kinds) == (ops.level in ("avxvnni", "avx512vnni", "avx512bf16"))  # vpdpbusd where it has VNNI
    assert (1 in kinds) == (ops.level == "avx512bf16")


@pytest.mark.parametrize("iters", ITERS)
def test_the_operations_counted_are_the_operations_done(ops: kernels.Kernels, iters: int) -> None:
    threads = torch.get_num_threads()
    for kind, name, _ in ops.module.peak_kinds():
        done, checksum = ops.module.peak_probe(kind, iters, 1.0)
        assert done == threads * iters * _per_round(ops, kind, name), name
        assert checksum == done // 2, name  # every multiply-add added 1 to its sum


def test_an_unknown_kind_or_no_rounds_does_nothing(ops: kernels.Kernels) -> None:
    assert tuple(ops.module.peak_probe(99, 1000, 1.0)) == (0, 0.0)
    assert tuple(ops.module.peak_probe(0, 0, 1.0)) == (0, 0.0)


def test_the_probe_gives_a_positive_finite_rate(ops: kernels.Kernels) -> None:
    for kind, name, operands in ops.module.peak_kinds():
        peak = flops._probe(ops.module, kind, name, operands, repeats=2, seconds=0.01)
        assert math.isfinite(peak.giga_ops) and peak.giga_ops > 0, name
        assert peak.instruction == name and peak.threads == torch.get_num_threads()


def test_the_probe_runs_on_torchs_threads(ops: kernels.Kernels) -> None:
    """One task a thread of torch's pool: with one thread, a round's operations once; the model's count again after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        done, _ = ops.module.peak_probe(0, 100, 1.0)
    finally:
        torch.set_num_threads(before)
    assert done == 100 * _per_round(ops, 0, "")

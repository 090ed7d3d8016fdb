"""The CPU kernel that adds LoRA updates beside a projection's output (kernels/csrc/ops/lora.h) against torch's
per-adapter matmuls, on every kernel variant this CPU runs: rows of several adapters, of adapters that leave the
projection alone (rank 0) and of the base model, strided inputs, odd widths; each row's bits alone as in the batch."""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.models.lora import AdapterWeights, LoraProjection, LoraState, ProjectionShape


def _tables(weights: list[AdapterWeights | None], shape: ProjectionShape,
            dtype: torch.dtype = torch.float32) -> LoraProjection:  # fmt: skip
    proj = LoraProjection(LoraState(), shape, dtype=dtype)
    for slot, w in enumerate(weights):
        proj.set_slot(slot, w)
    return proj


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (37, 53)])  # whole vectors; tails past them
@pytest.mark.parametrize("tables", [torch.float32, torch.bfloat16])  # the adapter's matrices as the kernel keeps them
def test_lora_add_equals_torchs_matmuls_per_adapter(ops: kernels.Kernels, dtype: torch.dtype, tol: float, k: int,
                                                    n: int, tables: torch.dtype) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(k + n)
    ranks = [16, 8, 0, 4]  # slot 2: an adapter that leaves this projection alone
    weights = [AdapterWeights(torch.randn(r, k, generator=gen), torch.randn(n, r, generator=gen), 0.5 + i)
               if r else None for i, r in enumerate(ranks)]  # fmt: skip
    proj = _tables(weights, ProjectionShape(k, (n,)), tables)
    wide = torch.randn(7, k + 5, generator=gen).to(dtype)
    x = wide[:, :k]  # rows k + 5 apart, as a slice of a wider buffer
    base = torch.randn(7, n, generator=gen).to(dtype)
    slots = torch.tensor([0, -1, 1, 2, 3, 0, 1], dtype=torch.int64)
    out = base.clone()
    bf16 = tables == torch.bfloat16
    ops.lora_add(x, out, slots, proj.a_ptrs, proj.bt_ptrs, proj.ranks, proj.scales, bf16)
    for t, slot in enumerate(slots.tolist()):
        w = weights[slot] if slot >= 0 else None
        if w is None:
            assert torch.equal(out[t], base[t])  # the base model's rows, and rank 0, are left alone
            continue
        a, b = w.a.to(tables).double(), w.b.to(tables).double()  # the matrices the kernel holds
        want = base[t].double() + (x[t].double() @ a.T @ b.T) * w.scale
        torch.testing.assert_close(out[t].double(), want, atol=tol * want.abs().max().item(), rtol=tol)
        alone = base[t : t + 1].clone()
        ops.lora_add(x[t : t + 1], alone, slots[t : t + 1], proj.a_ptrs, proj.bt_ptrs, proj.ranks, proj.scales, bf16)
        assert torch.equal(alone[0], out[t])


def test_lora_add_refuses_a_slot_past_its_tables(ops: kernels.Kernels) -> None:
    proj = _tables([AdapterWeights(torch.ones(2, 8), torch.ones(8, 2), 1.0)], ProjectionShape(8, (8,)))
    x, out = torch.ones(1, 8), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="past the 1 slots"):
        ops.lora_add(x, out, torch.tensor([1]), proj.a_ptrs, proj.bt_ptrs, proj.ranks, proj.scales)

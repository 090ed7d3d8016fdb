"""A step's rows grouped by LoRA adapter (runner._lora_batch) and each projection's update over them
(models/lora.py), against the update computed row by row."""

from __future__ import annotations

import torch

from tokenmill.forward import flatten
from tokenmill.models.lora import AdapterWeights, LoraProjection, LoraState, ProjectionShape
from tokenmill.runner import _lora_batch
from tokenmill.types import SequenceInput


def _seq(rid: str, n: int, lora_id: int) -> SequenceInput:
    return SequenceInput(rid, list(range(n)), 0, [], 64, None, lora_id=lora_id)


def test_rows_group_by_adapter_as_slices_where_consecutive_else_indices() -> None:
    # decodes first (flatten), then prefills: adapter 1's rows are 0 and 5..7, adapter 2's are 2..4 (one slice)
    rows = flatten([_seq("a", 1, 1), _seq("b", 3, 2), _seq("c", 1, 0), _seq("d", 3, 1)])
    groups = dict(_lora_batch(rows, torch.device("cpu")).groups)
    assert set(groups) == {1, 2}  # the base model's rows take no group
    assert groups[2] == slice(2, 5)
    assert isinstance(groups[1], torch.Tensor) and groups[1].tolist() == [0, 5, 6, 7]
    assert rows.offsets == [0, 1, 2, 5]


def test_each_row_takes_only_its_own_adapters_update() -> None:
    torch.manual_seed(0)
    d_in, d_out = 8, 6
    state = LoraState()
    proj = LoraProjection(state, ProjectionShape(d_in, (d_out,)))
    weights = {i: AdapterWeights(torch.randn(r, d_in), torch.randn(d_out, r), s)
               for i, r, s in ((1, 2, 0.5), (2, 4, 2.0))}  # fmt: skip
    proj.adapters.update(weights)
    rows = flatten([_seq("a", 1, 1), _seq("b", 3, 2), _seq("c", 1, 0), _seq("d", 3, 1)])
    owner = [1, 0, 2, 2, 2, 1, 1, 1]  # each row's adapter in row order (0: the base model)
    x, base = torch.randn(8, d_in), torch.randn(8, d_out)
    state.batch = _lora_batch(rows, torch.device("cpu"))
    out = proj.add(x, base.clone())
    for r, a in enumerate(owner):
        w = weights.get(a)
        want = base[r] if w is None else base[r] + (x[r] @ w.a.T @ w.b.T) * w.scale
        assert torch.allclose(out[r], want, atol=1e-6), r

"""What every forward path shares: the step's rows as the model computes them, what a path returns, and the
protocol each path follows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenmill.types import SequenceInput, StepPlan


@dataclass
class Rows:
    """A step's batch flattened for the model: one-token sequences first (a backend may attend to them in one
    call), each sequence's tokens at consecutive rows."""

    sequences: list[SequenceInput]  # in row order: the first `num_decodes` have one new token each
    num_decodes: int
    input_ids: list[int] = field(default_factory=list)  # [T]
    # [T]; -1 - p where p rotates by LongRoPE's long factors below their start (SequenceInput.rope_long_below)
    positions: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # [B]: each sequence's first row


@dataclass
class Forward:
    """What a path computed. Where it gave `logits`, they hold every row's, in row order."""

    hidden: torch.Tensor | None  # [T, D] the final norm's output; None where a CUDA graph gave only the logits
    logits: torch.Tensor | None = None  # [T, V]: float32, or the model's dtype where the plan reads only a draw
    argmax: torch.Tensor | None = None  # [T] int64: each row's argmax, where the path took it


class ForwardPath(Protocol):
    name: str

    def supports(self, plan: StepPlan, rows: Rows) -> bool:
        """This path can compute the step `plan` describes (and everything the plan says is read of it)."""
        ...

    def forward(self, plan: StepPlan, rows: Rows) -> Forward: ...


def flatten(sequences: list[SequenceInput]) -> Rows:
    """The rows of `sequences`, one-token sequences first."""
    ordered = [s for s in sequences if s.num_new_tokens == 1]
    num_decodes = len(ordered)
    ordered += [s for s in sequences if s.num_new_tokens != 1]
    rows = Rows(ordered, num_decodes)
    for s in ordered:
        rows.offsets.append(len(rows.input_ids))
        rows.input_ids += s.token_ids
        if s.start >= s.rope_long_below:
            rows.positions += range(s.start, s.seq_len)
        else:  # (a position below rope_long_below goes only to the modules: StepPlan.decode_only is False for it)
            rows.positions += (p if p >= s.rope_long_below else -1 - p for p in range(s.start, s.seq_len))
    return rows

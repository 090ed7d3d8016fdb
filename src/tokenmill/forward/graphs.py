"""Decode-only steps as CUDA graph replays (cuda_graphs.py): every row's float32 logits, no hidden states."""

from __future__ import annotations

from tokenmill.cuda_graphs import DecodeGraphs
from tokenmill.forward.base import Forward, Rows
from tokenmill.types import StepPlan


class GraphsPath:
    name = "cuda_graphs"

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = graphs

    def supports(self, plan: StepPlan, rows: Rows) -> bool:
        """A decode-only step of a size some bucket holds, that reads no hidden state (prompt logprobs, pooling) and
        whose rows take no LoRA adapter (the recorded graphs hold none)."""
        return (
            plan.decode_only
            and not (plan.prompt_logprobs or plan.pooling or plan.lora)
            and len(rows.sequences) <= self.graphs.batch_buckets[-1]
        )

    def forward(self, plan: StepPlan, rows: Rows) -> Forward:
        return Forward(None, self.graphs.logits(rows.sequences))  # [B, V] float32

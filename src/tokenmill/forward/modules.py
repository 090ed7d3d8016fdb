"""The reference path: the model's own modules over the KV backend's metadata. It computes any step."""

from __future__ import annotations

import torch

from tokenmill.attention import KVBackend
from tokenmill.forward.base import Forward, Rows
from tokenmill.models import CausalLM
from tokenmill.types import StepPlan


class ModulesPath:
    name = "modules"

    def __init__(self, model: CausalLM, kv: KVBackend, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv, device

    def supports(self, plan: StepPlan, rows: Rows) -> bool:
        return True

    def forward(self, plan: StepPlan, rows: Rows) -> Forward:
        meta = self.kv.prepare(rows.sequences, rows.num_decodes)
        ids_t, pos_t = token_tensors(rows, self.device)
        return Forward(self.model(ids_t, pos_t, self.kv, meta))  # [T, D]


def token_tensors(rows: Rows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' token ids and positions, [T] int64 each, from one host-to-device copy."""
    tokens = torch.tensor(rows.input_ids + rows.positions, dtype=torch.int64, device=device)
    return tokens[: len(rows.input_ids)], tokens[len(rows.input_ids) :]

"""Decode-only steps through every decoder layer in one native call (models/decode_stack.py), and decode runs:
several such steps in one call, each fed the last one's tokens. Both apply the rows' LoRA adapters where the stack
has the model's (`DecodeStack.takes_lora`)."""

from __future__ import annotations

import torch

from tokenmill.forward.base import Forward, Rows
from tokenmill.forward.modules import token_tensors
from tokenmill.models.decode_stack import DecodeStack
from tokenmill.sampling_params import SamplingParams
from tokenmill.types import SequenceInput, StepPlan


class StackListsPath:
    """The stack fed from Python lists, with no torch op on the way: it reads the embedding rows itself."""

    name = "decode_stack"

    def __init__(self, stack: DecodeStack) -> None:
        self.stack = stack

    def supports(self, plan: StepPlan, rows: Rows) -> bool:
        return plan.decode_only and (not plan.lora or self.stack.takes_lora) and self.stack.plain_embedding

    def forward(self, plan: StepPlan, rows: Rows) -> Forward:
        # [B, D], [B, V] (None where the plan reads only the argmax), [B]
        hidden, logits, argmax = self.stack.step(rows.sequences, rows.input_ids, rows.positions, plan.logits)
        return Forward(hidden, logits, argmax)


class StackMetadataPath:
    """The stack over the KV backend's metadata, from the embedded tokens (an embedding it cannot read itself)."""

    name = "decode_stack_metadata"

    def __init__(self, stack: DecodeStack, device: torch.device) -> None:
        self.stack, self.device = stack, device

    def supports(self, plan: StepPlan, rows: Rows) -> bool:
        return plan.decode_only and (not plan.lora or self.stack.takes_lora)

    def forward(self, plan: StepPlan, rows: Rows) -> Forward:
        meta = self.stack.kv.prepare(rows.sequences, rows.num_decodes)
        ids_t, pos_t = token_tensors(rows, self.device)
        hidden, logits, argmax = self.stack.step_from_metadata(ids_t, pos_t, meta)  # [B, D], [B, V] float32, [B]
        return Forward(hidden, logits, argmax)


class DecodeRunPath:
    """A decode run (`plan.num_steps` > 1): that many decode steps of every sequence in one native call, each token
    the head's argmax or the draw the sampler's kernel would make (DecodeStack.decode_run)."""

    name = "decode_run"

    def __init__(self, stack: DecodeStack) -> None:
        self.stack = stack

    def supports(self, plan: StepPlan, rows: Rows) -> bool:
        return (plan.num_steps > 1 and plan.decode_only and not plan.drafts
                and (not plan.lora or self.stack.takes_lora) and self.stack.greedy_ready)  # fmt: skip

    def run(
        self, sequences: list[SequenceInput], steps: int, draws: tuple[list[SamplingParams], list[list[float]]] | None
    ) -> list[list[int]]:
        """Each sequence's `steps` tokens; `draws`: the rows' params [B] and each step's uniforms [steps][B]."""
        return self.stack.decode_run(sequences, steps, draws)

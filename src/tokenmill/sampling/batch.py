"""A batch's sampling settings, row by row, as the sampler (sampler.py) and its filters (filters.py) read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.step_plan import penalizes
from tokenmill.types import LogitsRead


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors ([B] each) plus the token history penalties need. The tensors are made
    on first use: a step of greedy rows without penalties reads none of them (building them was ~0.1 ms a step)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    suppressed_token_ids: list[list[int]]  # per row: ids that must not be sampled this step
    num_logprobs: list[int | None]
    device: torch.device | str = "cpu"
    bitmask: torch.Tensor | None = None  # [B, W] int32, bit t of row b set = token t allowed; None: no grammar
    logit_bias: list[dict[int, float] | None] | None = None  # per row: token id -> added to its logit
    # NOTE: decided from the parameters, so that a step runs no tensor test of the columns below (after a step's
    # weights have streamed through the caches, every torch op's first call is cold: tens of us)
    penalized: bool = True  # some row has a repetition, presence or frequency penalty
    sampled: bool = True  # some row draws (temperature > 0)
    min_p_rows: bool = True  # some row has a min-p
    reads: LogitsRead = LogitsRead.FULL  # what the step's plan says sampling reads of the logits (types.StepPlan)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[list[int]],
        output_token_ids: Sequence[list[int]],
        generators: Sequence[torch.Generator | None],
        suppressed_token_ids: Sequence[list[int]],
        device: torch.device | str = "cpu",
        bitmask: torch.Tensor | None = None,
        reads: LogitsRead = LogitsRead.FULL,
    ) -> SamplingBatch:
        return cls(
            params=list(params),
            generators=list(generators),
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            suppressed_token_ids=list(suppressed_token_ids),
            num_logprobs=[p.logprobs for p in params],
            device=device,
            bitmask=None if bitmask is None else bitmask.to(device),
            logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else None,
            penalized=any(penalizes(p) for p in params),
            sampled=any(p.temperature > 0 for p in params),
            min_p_rows=any(p.min_p > 0 for p in params),
            reads=reads,
        )

    @cached_property
    def _floats(self) -> torch.Tensor:  # [6, B]: one tensor, its rows are the float columns below
        return torch.tensor(
            [[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty]
             for p in self.params], dtype=torch.float32,
        ).T.to(self.device)  # fmt: skip

    @cached_property
    def top_k(self) -> torch.Tensor:  # [B] int64, 0 when off
        return torch.tensor([max(p.top_k, 0) for p in self.params], dtype=torch.int64, device=self.device)

    # [B] float32 each, rows of _floats (temperature: 0 for greedy rows)
    temperature = property(lambda self: self._floats[0])
    top_p = property(lambda self: self._floats[1])
    min_p = property(lambda self: self._floats[2])
    repetition_penalty = property(lambda self: self._floats[3])
    presence_penalty = property(lambda self: self._floats[4])
    frequency_penalty = property(lambda self: self._floats[5])

"""Engine-internal request state: pure data, no tensors.

One `Request` is one sequence being generated. A user request with `n > 1` becomes n Requests sharing a
`parent_id`; the output processor groups them back into one `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tokenmill.outputs import Logprobs, RequestMetrics
from tokenmill.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    parent_id: str
    index: int  # which of the parent's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # output budget, already capped by the model's context
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics
    arrival_order: int = 0  # ties in priority break by arrival
    priority: int = 0  # lower runs first under the "priority" policy (vLLM's convention)
    seed: int | None = None
    fork_of: str | None = None  # sibling whose computed prompt blocks this sample shares (n > 1)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_order)

    def stop_ids_active(self) -> list[int]:
        """Tokens that would end this sequence now; `min_tokens` suppresses them until it is reached."""
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

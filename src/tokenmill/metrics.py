"""Engine-wide statistics: what each step did and running totals. Pure data, filled by the engine core.

(Per-request facts live in `outputs.RequestMetrics`.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepStats:
    batch_size: int  # requests that computed tokens this step
    num_tokens: int  # tokens computed (prefill chunks + decodes)
    num_decode_tokens: int  # of which single-token decodes
    kv_usage: float  # fraction of KV blocks in use after the step (0 for the baselines)
    duration_s: float


@dataclass
class EngineStats:
    num_steps: int = 0
    sum_batch_size: int = 0
    max_batch_size: int = 0
    num_preemptions: int = 0
    num_completed: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    recent_steps: deque[StepStats] = field(default_factory=lambda: deque(maxlen=1024))

    def record(self, step: StepStats) -> None:
        self.num_steps += 1
        self.sum_batch_size += step.batch_size
        self.max_batch_size = max(self.max_batch_size, step.batch_size)
        self.recent_steps.append(step)

    @property
    def mean_batch_size(self) -> float:
        return self.sum_batch_size / self.num_steps if self.num_steps else 0.0

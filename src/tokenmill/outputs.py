"""What the engine hands back: pure data, shaped like vLLM's outputs."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

# token id -> log-probability; holds the sampled (or prompt) token plus the top-k
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Facts about one request. Times are `time.perf_counter()` seconds; derived figures are in ms."""

    arrival_time: float
    tokenization_ms: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or shared with a sibling sample)
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative drafts verified for this request
    num_accepted_tokens: int = 0  # of which the target kept
    token_times: list[float] = field(default_factory=list)  # when each generated token appeared
    # forward path name (forward/: "decode_stack", "decode_run", "modules", ...) -> the steps of this request it ran
    forward_steps: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_ms(self) -> float | None:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return (self.first_token_time - self.first_scheduled_time) * 1000

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_time is None:
            return None
        return (self.first_token_time - self.arrival_time) * 1000

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between consecutive generated tokens."""
        t = self.token_times
        return [(b - a) * 1000 for a, b in itertools.pairwise(t)]

    @property
    def token_ms(self) -> list[float]:
        """One entry per generated token after the first: its step's duration over the tokens that step gave (a
        decode run, or a verification's kept drafts, gives several at once)."""
        counts = Counter(self.token_times)
        times = sorted(counts)
        return [(b - a) * 1000 / counts[b] for a, b in itertools.pairwise(times) for _ in range(counts[b])]

    @property
    def decode_tokens_per_sec(self) -> float | None:
        """Tokens after the first over the time after the first (the decode rate; TTFT excluded)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generated_tokens < 2:
            return None
        elapsed = self.last_token_time - self.first_token_time
        return (self.num_generated_tokens - 1) / elapsed if elapsed > 0 else None


@dataclass
class PoolingOutput:
    """A pooling request's result: an embedding, or a score as its one value."""

    data: list[float]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[Logprobs | None] | None = None
    metrics: RequestMetrics | None = None
    new_text: list[str] = field(default_factory=list)  # per completion: text added since the last output
    error: str | None = None  # set when a failure inside the engine ended this request (finish_reason "error")
    # a pooling request's result (its `outputs` are empty; it comes once, finished); None where it was aborted
    pooled: PoolingOutput | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt, as vLLM's: `.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result per pair, as vLLM's: `.outputs.score`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True

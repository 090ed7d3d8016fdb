"""Engine-internal request state and the contracts between the engine's parts: pure data, no tensors.

Who writes what (one writer each):
- `Request` is written by the engine core alone (`EngineCore.add_request`, `update_from_output`, `abort`, and
  engine/request_tokens.py's helpers, which only the core calls).
  The scheduler and the output processor read it.
- `SchedulerOutput` is the scheduler's decision for one step: who runs, from which token, how many tokens.
- `ModelInput` is the core's description of that batch for the runner; the runner never sees a `Request`.
  Its one tensor is the grammar bitmask of constrained sequences (structured_output/). Its `StepPlan` (made by
  step_plan.py alone) says what the step computes and what its sampling reads.
- `RunnerOutput` is what the runner computed: sampled tokens, prompt logprobs and pooled vectors, by request id.

One `Request` is one sequence being generated. A user request with `n > 1` becomes n Requests sharing a
`parent_id`; the output processor groups them back into one `RequestOutput`. A pooling request (`pooling` set:
pooling_params.py) is one sequence that samples nothing: its prompt is computed and pooled, and it ends there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from tokenmill.outputs import Logprobs, RequestMetrics
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A validated user request, as the core receives it (see `EngineCore.validate`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # output budget, already capped by the model's context
    prompt: str | None = None
    arrival_time: float = 0.0  # time.perf_counter(); 0: when the core receives it
    tokenization_ms: float = 0.0
    priority: int = 0
    grammar: Any = None  # params.structured_outputs compiled (off the engine thread); None: the core compiles it
    pooling: PoolingParams | None = None  # a pooling request: its prompt is pooled and nothing generated (max_tokens 0)
    lora: str | None = None  # the LoRA adapter it runs with (its name); None: the base model


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
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while unfinished
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[Logprobs | None] | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed to follow the known tokens
    spec_misses: int = 0  # verification rounds in a row that kept no draft
    spec_skip: int = 0  # steps to go without drafts (after misses: 2, 4, ... 64)
    # decode steps this sequence may take in one call next step (0: it may not; scheduler._decode_runs)
    multi_step_limit: int = 0
    pooling: PoolingParams | None = None  # a pooling request (it samples nothing)
    pooled: list[float] | None = None  # its pooler's result, once its prompt is computed
    # every prompt position is computed, none taken from the prefix cache: its hidden states are all read (mean
    # pooling) (prompt logprobs are the other such case: `params.prompt_logprobs`)
    no_prefix_cache: bool = False
    lora_id: int = 0  # the LoRA adapter it runs with (the core's id for it; 0: the base model)
    cache_salt: int | None = None  # its prefix-cache hashes start from this (its adapter's digest): none is shared
    # LongRoPE (Phi-3): the original context (0: no such model), and where the sequence has passed it, the same
    # number in rope_long_below: its positions below it rotate by the long factors too (models/rope.py), and its
    # prefix chain is its own (scheduler.prefix_salt). A prompt longer than the context starts so; a sequence that
    # grows past it is computed again so once (transformers' Phi-3 `generate` recomputes its cache there)
    rope_long_from: int = 0
    rope_long_below: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def short_rope_steps(self) -> int | None:
        """The decode steps left before the sequence passes LongRoPE's original context (each step's position must
        stay below it while the short factors rotate it; 0: it has passed, and is to be computed again with the
        long ones), or None where no switch is ahead."""
        if not self.rope_long_from or self.rope_long_below:
            return None
        return max(0, self.rope_long_from - self.num_tokens + 1)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_order)

    def stop_ids_active(self) -> list[int]:
        """Tokens that would end this sequence now; `min_tokens` suppresses them until it is reached."""
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)


# -- scheduler -> core ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache when this step starts (a prefix hit, for a new one)
    num_new_tokens: int  # computed this step (the drafts included)
    block_table: list[int]  # the request's KV block ids after this step's allocation ([] without paging)
    spec_token_ids: tuple[int, ...] = ()  # drafts computed after the request's known tokens, verified this step


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # lost their KV blocks: recomputed from 0 when readmitted
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # admitted now -> tokens found computed
    num_steps: int = 1  # > 1: a decode run: every scheduled sequence decodes this many steps in one call

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step: a decode run's steps each compute one."""
        return sum(s.num_new_tokens + self.num_steps - 1 for s in self.scheduled)


# -- core -> runner -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingInput:
    """What the sampler needs for a sequence that reaches its end this step. The id lists are read, not kept."""

    params: SamplingParams
    seed: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # per sampled position (1 + the drafts): ids that may not be sampled there (stop tokens before min_tokens)
    suppressed_token_ids: list[list[int]]
    draft_token_ids: tuple[int, ...] = ()  # proposed to follow; position j samples after drafts [0, j)


@dataclass(frozen=True)
class PromptLogprobsInput:
    """Score prompt positions [first, first + count): position p scores prompt token p + 1."""

    first: int
    count: int
    num_top: int
    target_token_ids: list[int]  # [count]


@dataclass(frozen=True)
class PoolingInput:
    """A pooling sequence's part of a step: the model's pooler reads its rows' hidden states; `finish`: the step
    reaches the prompt's end, and the pooled vector is made."""

    params: PoolingParams
    finish: bool


@dataclass(frozen=True)
class SequenceInput:
    """One sequence of the batch: compute `token_ids` at positions start, start + 1, ..."""

    request_id: str
    token_ids: list[int]
    start: int  # tokens already in the KV cache
    block_table: list[int]  # paged KV: the sequence's block ids
    max_num_tokens: int  # the most tokens this sequence can ever hold (prompt + output budget)
    sampling: SamplingInput | None  # set when this step reaches the sequence's last known token
    prompt_logprobs: PromptLogprobsInput | None = None
    pooling: PoolingInput | None = None  # a pooling request's: it never samples
    lora_id: int = 0  # the LoRA adapter its rows take (0: the base model's rows add nothing)
    rope_long_below: int = 0  # its positions below this rotate by LongRoPE's long factors (Request.rope_long_below)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached + new)."""
        return self.start + len(self.token_ids)


class LogitsRead(IntEnum):
    """What sampling reads of a row's logits, least first: a step reads the most that any of its rows does."""

    ARGMAX = 0  # only their argmax (greedy, and nothing else reads them)
    DRAW = 1  # a draw (temperature, top-k, top-p, min-p) and nothing else: the CPU kernels draw in the model's dtype
    FULL = 2  # float32 logits: logprobs, a penalty, a logit bias, suppressed tokens, a grammar, drafts, no sampling


@dataclass(frozen=True)
class StepPlan:
    """What a step computes and what its sampling reads, decided once (step_plan.plan_step) and read by the runner's
    choice of forward path, the decode stack's logits and the sampler."""

    num_steps: int = 1  # > 1: a decode run: that many decode steps in one call, each fed the last one's tokens
    logits: LogitsRead = LogitsRead.FULL  # what the step's sampling reads of its rows' logits
    draws: bool = False  # some row draws (temperature > 0): the step takes a uniform number per row
    drafts: bool = False  # some sequence verifies drafts (a row per draft after its known token)
    decode_only: bool = False  # every sequence computes one known token (and its drafts), each its own row
    prompt_logprobs: bool = False  # some sequence scores prompt positions: the hidden states of its rows are read
    pooling: bool = False  # some sequence is pooled: the hidden states of its rows are read
    lora: bool = False  # some sequence runs with a LoRA adapter: only the modules apply them


@dataclass(frozen=True)
class ModelInput:
    sequences: list[SequenceInput]
    plan: StepPlan
    # structured output: row i of the bitmask ([R, W] int32, the one tensor in these contracts) holds the tokens
    # the sequence grammar_rows maps to row i may sample; those sequences carry no drafts
    grammar_bitmask: Any = None
    grammar_rows: dict[str, int] = field(default_factory=dict)


# -- runner -> core -------------------------------------------------------------------------------------------
@dataclass
class RunnerOutput:
    # request id -> its new tokens: the drafts the target kept, then one token of the target's own (a decode run:
    # each of its steps' tokens)
    sampled: dict[str, list[tuple[int, Logprobs | None]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)  # request id -> new entries
    pooled: dict[str, list[float]] = field(default_factory=dict)  # request id -> its pooled vector, once finished
    forward_path: str | None = None  # the name of the forward path that computed the step (None: no step ran)

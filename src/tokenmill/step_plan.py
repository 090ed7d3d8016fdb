"""A step's plan, made in one place: `plan_step` turns the batch the scheduler chose (as the core's
`SequenceInput`s, with the decode-run length it granted) and the batch's sampling settings into a `StepPlan`, which
rides in the `ModelInput`. Nothing after it decides these again: the runner picks its forward path by the plan,
the decode stack computes the logits it names, and the sampler takes them as it says.

`row_reads` is the rule for one row. `run_steps_allowed` applies it to say how many decode steps a sequence may take
in one call next step (the core sets it as `Request.multi_step_limit` after each step); the scheduler grants the
least of them when every sequence of a step may run and their KV slots fit, and `plan_step` records what it granted.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tokenmill.sampling_params import SamplingParams
from tokenmill.types import LogitsRead, ModelInput, Request, SequenceInput, StepPlan


def penalizes(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def row_reads(params: SamplingParams, suppressed_token_ids: Sequence[int], constrained: bool) -> LogitsRead:
    """What sampling one row reads of its logits: float32 logits for logprobs, a penalty, a logit bias, suppressed
    tokens or a grammar; else a draw, or only the argmax."""
    if constrained or suppressed_token_ids or params.logprobs is not None or params.logit_bias or penalizes(params):
        return LogitsRead.FULL
    return LogitsRead.DRAW if params.temperature > 0 else LogitsRead.ARGMAX


def run_steps_allowed(req: Request, steps: int, max_model_len: int, constrained: bool) -> int:
    """The decode steps `req` may take in one call next step (0: none): up to `steps` for a decode past its first
    token whose logits nothing but a draw or the argmax reads (no logprobs, penalty, bias, grammar (`constrained`),
    drafts or min_tokens still to reach), within its output budget and the context. A greedy or seeded row's tokens
    are then the ones single steps would give (the same kernels over the same batch, the same uniform numbers); an
    unseeded row's draws take the sampler's numbers in another order once a row of its run stops early, from the
    same distribution."""
    p, num_out = req.params, len(req.output_token_ids)
    left = min(req.max_tokens - num_out, max_model_len - req.num_tokens)
    if req.short_rope_steps is not None:  # not past LongRoPE's switch (Request.rope_long_from)
        left = min(left, req.short_rope_steps)
    only_draws = row_reads(p, [], constrained) <= LogitsRead.DRAW
    # past the first token: a prompt's last chunk of one token samples its first at once
    decoding = num_out > 0 and not req.spec_token_ids and req.num_computed_tokens == req.num_tokens - 1
    runs = only_draws and decoding and not req.finished and num_out >= p.min_tokens and left > 0
    return min(steps, left) if runs else 0


def plan_step(sequences: Sequence[SequenceInput], constrained: Collection[str], num_steps: int = 1) -> StepPlan:
    """The plan of a step computing `sequences`, of which those with ids in `constrained` sample under a grammar;
    `num_steps` > 1: the scheduler granted a decode run of that many steps."""
    rows = [s.sampling for s in sequences if s.sampling is not None]
    drafts = any(r.draft_token_ids for r in rows)
    reads = [row_reads(s.sampling.params, ids, s.request_id in constrained)
             for s in sequences if s.sampling is not None
             for ids in s.sampling.suppressed_token_ids or [[]]]  # fmt: skip
    logits = max(reads, default=LogitsRead.FULL)
    if len(rows) < len(sequences) or drafts:  # a prompt's chunk that samples nothing (or is pooled), or drafts
        logits = LogitsRead.FULL
    decode_only = all(s.num_new_tokens == 1 + (len(s.sampling.draft_token_ids) if s.sampling else 0)
                      and s.start >= s.rope_long_below for s in sequences)  # fmt: skip
    return StepPlan(
        num_steps=num_steps,
        logits=logits,
        draws=any(r.params.temperature > 0 for r in rows),
        drafts=drafts,
        decode_only=bool(sequences) and decode_only,
        prompt_logprobs=any(s.prompt_logprobs is not None for s in sequences),
        pooling=any(s.pooling is not None for s in sequences),
        lora=any(s.lora_id for s in sequences),
    )


def model_input(
    sequences: list[SequenceInput], num_steps: int = 1, grammar_bitmask: object = None,
    grammar_rows: dict[str, int] | None = None,
) -> ModelInput:  # fmt: skip
    """The runner's input for `sequences`, with its plan (constrained sequences: `grammar_rows`, rows of the
    bitmask [R, W] int32)."""
    rows = grammar_rows or {}
    return ModelInput(sequences, plan_step(sequences, rows, num_steps), grammar_bitmask, rows)

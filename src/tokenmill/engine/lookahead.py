"""What the core asks of the next step beyond one token a sequence: speculative drafts (spec_decode/) and decode
runs (several steps in one call). Pure reads of the requests; EngineCore writes what they decide."""

from __future__ import annotations

from tokenmill.engine.thinking import ThinkingBudgets
from tokenmill.spec_decode import DraftRequest
from tokenmill.step_plan import run_steps_allowed
from tokenmill.structured_output import StructuredOutputManager
from tokenmill.types import Request


def draft_requests(
    running: list[Request], off: bool, structured: StructuredOutputManager, thinking: ThinkingBudgets,
    max_model_len: int,
) -> list[DraftRequest]:  # fmt: skip
    """The drafts to ask for: each running sequence that decodes next step and may take some (`off`: none; a
    sequence pausing its drafts, `spec_skip`, is left out: the core counts its pause down)."""
    asks = []
    for req in running:
        constrained = structured.has(req.request_id)  # no drafts: they would skip the grammar
        pooled = req.pooling is not None  # it samples nothing
        if off or req.spec_skip > 0 or constrained or pooled or req.finished:
            continue
        if req.num_computed_tokens != req.num_tokens - 1:
            continue
        # each kept draft and the token after them are outputs: stay inside max_tokens and the context
        limit = min(req.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens) - 1
        if req.short_rope_steps is not None:  # no verify row past LongRoPE's switch (Request.rope_long_from)
            limit = min(limit, req.short_rope_steps - 1)
        free = thinking.free_tokens(req.request_id)  # drafts stop short of a token a budget forces
        limit = limit if free is None else min(limit, free - 1)
        if limit >= 1:
            asks.append(DraftRequest(req.request_id, req.all_token_ids, limit))
    return asks


def run_limit(
    req: Request, scheduler_steps: int, max_model_len: int, structured: StructuredOutputManager,
    thinking: ThinkingBudgets,
) -> int:  # fmt: skip
    """How many decode steps `req` may take in one call next step (step_plan.run_steps_allowed), stopping short of a
    token a thinking budget forces."""
    limit = run_steps_allowed(req, scheduler_steps, max_model_len, structured.has(req.request_id))
    free = thinking.free_tokens(req.request_id)
    return limit if free is None else min(limit, free)

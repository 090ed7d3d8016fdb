"""Decode runs' first half: how many decode steps a sequence may take in one call (`Request.decode_run`, which the
core sets after each step). The scheduler (`Scheduler._decode_runs`) decides whether a step takes them."""

from __future__ import annotations

from tokenmill.step_plan import row_reads
from tokenmill.types import LogitsRead, Request


def decode_run_length(req: Request, steps: int, max_model_len: int, constrained: bool) -> int:
    """The decode steps `req` may take in one call next step (its `decode_run`, which the core sets; 0: none): up
    to `steps` for a decode past its first token whose logits nothing but a draw or the argmax reads (no logprobs,
    penalty, bias, grammar (`constrained`), drafts or min_tokens still to reach), within its output budget and the
    context. A greedy or seeded row's tokens are then the ones single steps would give (the same kernels over the
    same batch, the same uniform numbers); an unseeded row's draws take the sampler's numbers in another order once
    a row of its run stops early, from the same distribution."""
    p, num_out = req.params, len(req.output_token_ids)
    left = min(req.max_tokens - num_out, max_model_len - req.num_tokens)
    only_draws = row_reads(p, [], constrained) <= LogitsRead.DRAW
    # past the first token: a prompt's last chunk of one token samples its first at once
    decoding = num_out > 0 and not req.spec_token_ids and req.num_computed_tokens == req.num_tokens - 1
    runs = only_draws and decoding and not req.finished and num_out >= p.min_tokens and left > 0
    return min(steps, left) if runs else 0

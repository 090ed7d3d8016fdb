"""Thinking budgets (`SamplingParams.thinking`): each sequence's reasoning counted as it is generated, and the end
of thinking forced once the budget is spent.

The core feeds every appended token (`accept`) and asks, while it builds a step, which token a sequence must
take next (`forced`): the runner samples that row under a one-token mask, as it samples a grammar's rows. A
decode run or drafts never carry a sequence past the point where a token is forced (`free_tokens`). Like a
grammar's matcher, the count follows the tokens a sequence has generated, so preemption leaves it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import ThinkingBudget


@dataclass
class _Thinking:
    budget: ThinkingBudget
    state: str  # "before" (not yet opened) | "thinking" | "ending" (its end being forced) | "done"
    count: int = 0  # reasoning tokens so far
    matched: int = 0  # tokens of the marker being watched for (start or end) matched at the output's tail
    forced: int = 0  # end tokens forced so far


class ThinkingBudgets:
    def __init__(self) -> None:
        self._seqs: dict[str, _Thinking] = {}

    def add(self, seq_id: str, budget: ThinkingBudget) -> None:
        self._seqs[seq_id] = _Thinking(budget, "thinking" if budget.opened else "before")
        if budget.opened and budget.max_tokens == 0:
            self._seqs[seq_id].state = "ending"

    def remove(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def forced(self, seq_id: str) -> int | None:
        """The token `seq_id` must take next, or None."""
        t = self._seqs.get(seq_id)
        return t.budget.end_token_ids[t.forced] if t is not None and t.state == "ending" else None

    def free_tokens(self, seq_id: str) -> int | None:
        """How many tokens `seq_id` may take before one may be forced (None: no limit)."""
        t = self._seqs.get(seq_id)
        if t is None or t.state == "done":
            return None
        if t.state == "ending":
            return 0
        left = t.budget.max_tokens - t.count
        return left + len(t.budget.start_token_ids) if t.state == "before" else left

    def accept(self, seq_id: str, token: int) -> None:
        t = self._seqs.get(seq_id)
        if t is None or t.state == "done":
            return
        b = t.budget
        if t.state == "ending":
            t.forced += 1
            t.state = "done" if t.forced == len(b.end_token_ids) else "ending"
            return
        marker = b.start_token_ids if t.state == "before" else b.end_token_ids
        t.matched = _advance(marker, t.matched, token)
        if t.state == "thinking":
            t.count += 1
        if t.matched == len(marker):  # the model wrote the marker itself
            t.state, t.matched, t.count = ("thinking", 0, 0) if t.state == "before" else ("done", 0, t.count)
            if t.state == "thinking" and b.max_tokens == 0:
                t.state = "ending"
        elif t.state == "thinking" and t.count >= b.max_tokens and t.matched == 0:
            t.state = "ending"


def _advance(marker: tuple[int, ...], matched: int, token: int) -> int:
    """How many of `marker`'s tokens end the output once `token` follows `matched` of them (markers are a few
    tokens: a plain restart check is enough)."""
    while True:
        if marker[matched] == token:
            return matched + 1
        if matched == 0:
            return 0
        matched = next((k for k in range(matched - 1, -1, -1) if marker[:k] == marker[matched - k : matched]), 0)

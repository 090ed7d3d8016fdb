"""Speculative decoding's acceptance rule (spec_decode/ says why it keeps the target's distribution)."""


def accepts_draft(sampled: int, draft: int) -> bool:
    """A draft stands when the target, sampling that position itself, drew it."""
    return sampled == draft

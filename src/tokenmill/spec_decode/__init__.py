"""Speculative decoding: a proposer guesses the next k tokens, the target model checks them all in one forward.

Verification (runner.py, with the rule in sampling/drafts.py) samples the target at each of the 1 + k positions,
exactly as it would without speculation (penalties, min_tokens, top-k/p, seeds), and keeps drafts while each
equals the target's own sample there; the first sample that differs, or the one after the last draft, ends the
run. For a proposer that proposes deterministically (n-gram lookup; a draft model decoding greedily) this is
speculative sampling's rejection rule: a draft d is kept with probability p(d), and a rejection samples from p
with d removed. So the output distribution is the target's, and greedy output is token for token the same.
"""

from __future__ import annotations

from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.request import DraftRequest, Proposer

__all__ = ["DraftRequest", "NgramProposer", "Proposer"]

"""Speculative decoding: a proposer guesses the next k tokens, the target model checks them all in one forward.

Verification (runner.py) samples the target at each of the 1 + k positions, exactly as it would without
speculation (penalties, min_tokens, top-k/p, seeds), and keeps drafts while each equals the target's own
sample there; the first sample that differs, or the one after the last draft, ends the run. For a proposer
that proposes deterministically (n-gram lookup; a draft model decoding greedily) this is speculative
sampling's rejection rule: a draft d is kept with probability p(d), and a rejection samples from p with d
removed. So the output distribution is the target's, and greedy output is token for token the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.request import DraftRequest, Proposer

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.loading import LoadedModel


def keeps(sampled: int, draft: int) -> bool:
    """The acceptance rule: a draft stands when the target, sampling that position itself, drew it."""
    return sampled == draft


def make_proposer(target: LoadedModel, cfg: EngineConfig, max_len: int) -> Proposer | None:
    """The proposer `cfg.speculative_model` names: prompt lookup ("ngram"), a draft model, or none."""
    if cfg.speculative_model == "ngram":
        return NgramProposer(cfg.num_speculative_tokens, cfg.ngram_prompt_lookup_min, cfg.ngram_prompt_lookup_max)
    if cfg.speculative_model is not None:
        from tokenmill.spec_decode.draft import build_draft_proposer

        return build_draft_proposer(target, cfg, max_len)
    return None


__all__ = ["DraftRequest", "NgramProposer", "Proposer", "keeps", "make_proposer"]

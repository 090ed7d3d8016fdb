"""Turning logits into tokens for a whole batch at once: penalties, temperature, filters, seeds, logprobs."""

from tokenmill.sampling import drafts
from tokenmill.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, topk_logprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "drafts", "topk_logprobs"]

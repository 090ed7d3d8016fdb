"""Quality of a quantized (or otherwise changed) model against its reference, teacher-forced on a text.

`score(loaded, text)` runs the model over the text in windows of `ctx` tokens (no KV cache, each window is
one causal prefill) and returns, per scored position, the argmax token and the log-likelihood of the true
next token; `compare(reference, candidate)` turns two such scores into the numbers quantization is held to:
top-1 agreement with the reference and each side's perplexity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.assembly.model import LoadedModel
from tokenmill.attention import causal


@dataclass
class Score:
    top1: torch.Tensor  # [N] argmax token at each scored position
    nll: torch.Tensor  # [N] -log p(true next token), float64

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())


@torch.inference_mode()
def score(loaded: LoadedModel, text: str, ctx: int = 256) -> Score:
    ids = loaded.tokenizer.encode(text)
    top1, nll = [], []
    for start in range(0, len(ids) - 1, ctx):
        window = ids[start : start + ctx + 1]
        if len(window) < 2:
            break
        inputs = torch.tensor(window[:-1], device=loaded.device)  # [T]
        n = len(window) - 1
        # one sequence, no KV cache: a plain causal prefill
        hidden = loaded.model(inputs, torch.arange(n, device=loaded.device), *causal(n, loaded.config.layer_windows()))
        logprobs = loaded.model.compute_logits(hidden).log_softmax(-1)  # [T, V] float32
        targets = torch.tensor(window[1:], device=loaded.device)
        top1.append(logprobs.argmax(-1).cpu())
        nll.append(-logprobs.gather(1, targets[:, None])[:, 0].double().cpu())
    return Score(torch.cat(top1), torch.cat(nll))


def compare(reference: Score, candidate: Score) -> dict[str, float]:
    """top1_agreement (fraction of positions with the same argmax) and both perplexities."""
    ppl_ref, ppl_cand = reference.perplexity, candidate.perplexity
    return {
        "positions": float(len(reference.top1)),
        "top1_agreement": (reference.top1 == candidate.top1).double().mean().item(),
        "perplexity_reference": ppl_ref,
        "perplexity": ppl_cand,
        "perplexity_change": ppl_cand / ppl_ref - 1.0,
    }

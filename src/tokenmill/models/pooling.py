"""Pooling models: a decoder's final hidden states (the final norm's output) turned into one vector per prompt.

`as_pooling_model` adapts a family's model, built on the meta device, before its weights load: a
sequence-classification checkpoint's `score` head joins it; a model that only pools loses its LM head (the weights
a checkpoint may still hold for it are skipped); and a checkpoint saved from the bare decoder (`Qwen3Model`, as
Qwen3-Embedding's, whose tensors lack the `model.` prefix) loads all the same. `Pooler` is the arithmetic the runner
applies to a pooled sequence's rows: stateless, the runner keeps a chunked prompt's running sum.

`POOLING_ARCHITECTURES` names the Hugging Face architectures that are pooling models of our families, with the
causal family whose code runs them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers import CausalLM, DecoderModel
from tokenmill.pooling_params import PoolingConfig, PoolingParams, PoolingTask

# HF architecture -> (the causal architecture whose code runs its decoder, the task it is made for)
POOLING_ARCHITECTURES: dict[str, tuple[str, PoolingTask]] = {
    "LlamaModel": ("LlamaForCausalLM", "embed"),
    "MistralModel": ("MistralForCausalLM", "embed"),  # e5-mistral-7b-instruct
    "Qwen2Model": ("Qwen2ForCausalLM", "embed"),
    "Qwen3Model": ("Qwen3ForCausalLM", "embed"),
    "LlamaForSequenceClassification": ("LlamaForCausalLM", "score"),
    "MistralForSequenceClassification": ("MistralForCausalLM", "score"),
    "Qwen2ForSequenceClassification": ("Qwen2ForCausalLM", "score"),
    "Qwen3ForSequenceClassification": ("Qwen3ForCausalLM", "score"),
}
# a bare decoder's tensor names -> ours (Qwen3-Embedding's checkpoint: `layers.0...`, not `model.layers.0...`)
_BARE_DECODER = (("embed_tokens.", "model.embed_tokens."), ("layers.", "model.layers."), ("norm.", "model.norm."))


class ScoreHead(nn.Module):
    """A sequence-classification head (HF's `score`: Linear(D, num_labels, bias=False)), a plain float32 matmul: the
    kernels' packed linears are for the model's large matrices, not a row or two."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))  # [L, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, L] float32
        return x.float() @ self.weight.float().t()


class NoLMHead(nn.Module):
    """Where a model that only pools would keep its LM head: it has none."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model was loaded to pool (--task embed or score): it computes no logits")


def as_pooling_model(model: CausalLM, config: PoolingConfig, generates: bool) -> None:
    """Adapt `model` (on the meta device, before loading) to pool as `config` says; `generates`: it also generates,
    so it keeps its LM head (a yes/no reranker reads the head's rows too)."""
    skipped: tuple[str, ...] = ()
    if config.head == "classifier":
        model.score = ScoreHead(model.config.hidden_size, config.num_labels)
    else:
        skipped += ("score.",)  # (a classifier checkpoint served as an embedder)
    if not generates and config.head != "yes_no":
        model.lm_head = NoLMHead()  # type: ignore[assignment]
        model.config = replace(model.config, tie_word_embeddings=False)  # nothing to tie the embedding to
        skipped += ("lm_head.",)
    model.hf_skipped_prefixes = (*model.hf_skipped_prefixes, *skipped)
    if type(model.decoder()) is DecoderModel and model.decoder() is getattr(model, "model", None):
        model.hf_renames = (*model.hf_renames, *_BARE_DECODER)


class Pooler:
    """What the runner applies to a pooled sequence: `reduce` each chunk of its rows, then `finish` the pooled hidden
    states of the sequences whose prompts are done, all at once."""

    def __init__(self, model: CausalLM, config: PoolingConfig) -> None:
        self.model, self.config = model, config

    @property
    def mean(self) -> bool:
        """A prompt's every row counts (its chunks' sums are kept until its last), not just its last."""
        return self.config.pooling == "mean"

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:  # [n, D] -> [D]
        """One chunk's part: the sum of its rows in float32 (mean), or a copy of its last row (last)."""
        if self.mean:
            return rows.float().sum(0)
        return rows[-1].clone()

    def finish(self, pooled: torch.Tensor, params: list[PoolingParams], dtype: torch.dtype) -> list[list[float]]:
        """The outputs of N finished sequences from their pooled hidden states [N, D] (mean: already divided by the
        prompt length): embeddings cut to their `dimensions` and normalised, or one score each. `dtype`: the model's
        hidden states' (the LM head's input)."""
        cfg = self.config
        if cfg.head == "classifier":
            assert isinstance(self.model.score, ScoreHead)
            logits = self.model.score(pooled)  # [N, L] float32
            return (logits.sigmoid() if cfg.activation == "sigmoid" else logits).tolist()
        if cfg.head == "yes_no":
            logits = self.model.compute_logits(pooled.to(dtype))[:, list(cfg.token_ids)]  # [N, 2]: "no", "yes"
            return logits.float().softmax(-1)[:, 1:].tolist()  # [N, 1]: P(yes)
        out = []
        for vector, p in zip(pooled.float(), params, strict=True):  # [D] each
            cut = vector[: p.dimensions] if p.dimensions else vector
            out.append((F.normalize(cut, dim=-1) if p.normalize else cut).tolist())
        return out

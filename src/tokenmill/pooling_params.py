"""What a model does besides generating, and what one pooling request asks of it: pure data, no torch.

A model runs as a generator, a pooler (an embedder or a scorer), or both (`ModelTask`). A pooling request is a
prompt that generates nothing: the scheduler computes its prompt (in chunks, like any prefill), the model's pooler
(models/pooling.py) turns its hidden states into one vector, and its KV blocks are freed.

- embed: the final norm's hidden states pooled (`last` token, as Qwen3-Embedding; or `mean`, where a
  sentence-transformers checkpoint says so), optionally cut to `dimensions` (Matryoshka), then normalised.
- score: one relevance score per prompt (a query and a document together): a sequence-classification head (`score`
  linear) at the last token, through a sigmoid (`classifier`); or a causal reranker's "yes" against "no" logit at the
  last token, P(yes) (`yes_no`, as Qwen3-Reranker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingTask = Literal["embed", "score"]
PoolingType = Literal["last", "mean"]
ScoreHead = Literal["none", "classifier", "yes_no"]
Activation = Literal["sigmoid", "identity"]


@dataclass(frozen=True)
class PoolingConfig:
    """How the model pools, fixed when it loads (assembly/task.py reads it from the checkpoint and `--task`)."""

    task: PoolingTask
    pooling: PoolingType = "last"
    head: ScoreHead = "none"  # what turns the pooled hidden state into the output (none: it is the embedding)
    num_labels: int = 1  # classifier: rows of the `score` head
    activation: Activation = "sigmoid"  # classifier: applied to its one logit
    token_ids: tuple[int, ...] = ()  # yes_no: the ids of "no" and "yes"
    matryoshka_dimensions: tuple[int, ...] = ()  # embed: the only `dimensions` allowed, where the checkpoint lists them


@dataclass(frozen=True)
class ModelTask:
    """What the loaded model serves: generation, pooling requests of one task, or both (`--task generate,embed`)."""

    generate: bool = True
    pooling: PoolingConfig | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """ "generate", "embed", "score": the tasks served, for messages and the server's routes."""
        return (("generate",) if self.generate else ()) + ((self.pooling.task,) if self.pooling else ())

    def serves(self, task: str) -> bool:
        return task in self.names


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options (vLLM's `PoolingParams`)."""

    task: PoolingTask = "embed"
    dimensions: int | None = None  # embed: keep the first `dimensions` values, then normalise (Matryoshka)
    normalize: bool = True  # embed: a unit vector (OpenAI's embeddings are)

    def __post_init__(self) -> None:
        if self.task not in ("embed", "score"):
            raise ValueError(f"task={self.task!r} is invalid: allowed embed, score")
        if self.dimensions is not None:
            if self.task != "embed":
                raise ValueError("dimensions applies to embeddings only")
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise ValueError(f"dimensions={self.dimensions!r} is invalid: allowed an integer >= 1")

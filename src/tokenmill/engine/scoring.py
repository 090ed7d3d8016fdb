"""Scoring inputs: which texts are paired, and how a query and a document become one prompt for the model's scorer.

- A sequence-classification head (a cross-encoder) reads the two texts as the tokenizer pairs them
  (`Tokenizer.encode_pair`, as transformers' `tokenizer(query, document)` and vLLM do).
- A causal yes/no reranker reads Qwen3-Reranker's prompt: its system turn, then `<Instruct>`, `<Query>` and
  `<Document>` in the user turn, and an empty think block; each of the three parts tokenized on its own, as the
  model card's reference code does.

Must not import torch: the server builds these prompts too.
"""

from __future__ import annotations

from tokenmill.pooling_params import PoolingConfig
from tokenmill.tokenizer import Tokenizer

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one with one, one with each of many, or many with as many (element by element)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(firsts) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(f"text_1 has {len(firsts)} texts and text_2 has {len(seconds)}: give one text_1, or as many "
                         "as text_2")  # fmt: skip
    return list(zip(firsts, seconds, strict=True))


def score_prompt(
    tokenizer: Tokenizer, pooling: PoolingConfig, query: str, document: str, instruction: str | None = None
) -> list[int]:
    """The token ids the model scores `document` against `query` from (`instruction`: a yes/no reranker's task
    description, Qwen3-Reranker's default where None)."""
    if pooling.head != "yes_no":
        return tokenizer.encode_pair(query, document)
    body = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return [t for part in (QWEN3_RERANKER_PREFIX, body, QWEN3_RERANKER_SUFFIX)
            for t in tokenizer.encode(part, add_special_tokens=False)]  # fmt: skip

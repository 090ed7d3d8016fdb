"""Request bodies of the pooling endpoints: OpenAI's embeddings, the Cohere/Jina rerank that vLLM and llama-server
serve, and vLLM's score. Strict as protocol.py's: unknown fields and wrong types are a 400 naming the field.

Must not import torch.
"""

from __future__ import annotations

from typing import Literal

from tokenmill.server.protocol import Int64, Text, TokenId, _Strict


class EmbeddingRequest(_Strict):
    model: Text | None = None
    # one text, several, one prompt as token ids, or several as token-id lists (as OpenAI's)
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes, as OpenAI's
    dimensions: Int64 | None = None  # the first `dimensions` values, renormalised (Matryoshka)
    user: Text | None = None
    # vLLM's extensions
    normalize: bool = True  # unit vectors (false: the pooled hidden state as it is)
    add_special_tokens: bool = True  # the tokenizer's own (Qwen3-Embedding's appends its end-of-text token)
    priority: Int64 = 0


class RerankDocument(_Strict):
    text: Text


class RerankRequest(_Strict):
    model: Text | None = None
    query: Text
    documents: list[Text | RerankDocument]
    top_n: Int64 | None = None  # the best `top_n` results (default, or 0 as vLLM takes it: every document)
    return_documents: bool = True  # each result carries its document's text (Jina's and vLLM's default)
    instruction: Text | None = None  # a yes/no reranker's task description (Qwen3-Reranker's `<Instruct>`)
    user: Text | None = None
    priority: Int64 = 0


class ScoreRequest(_Strict):
    model: Text | None = None
    text_1: Text | list[Text]  # one query for every text_2, or one per text_2
    text_2: Text | list[Text]
    instruction: Text | None = None  # a yes/no reranker's task description
    user: Text | None = None
    priority: Int64 = 0

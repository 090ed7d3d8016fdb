"""A tied LM head packed in bf16 holds the token table's very values: the embedding looks its rows up in the
head's panels (models/packed_embedding.py: share_tied_table) instead of keeping a dense copy beside them, and
nothing the model computes changes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.parity.test_gguf_loading import PROMPTS, _greedy, _logits
from tokenmill import LLM
from tokenmill.models import linear
from tokenmill.models.packed_embedding import PackedEmbedding


def test_a_tied_bf16_table_is_kept_once(make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint("qwen2", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    shared = LLM(str(ckpt), dtype="bfloat16")
    model = shared.loaded.model
    emb = model.embeddings()
    assert isinstance(emb, PackedEmbedding) and emb.format == "bf16"
    assert emb.data is model.lm_head.data  # the head's panels, and no dense table beside them
    assert not any(type(m) is nn.Embedding for m in model.modules())
    stack = shared.engine.runner.decode_stack
    assert stack is not None and stack.greedy_ready and stack.embed_table is emb.data  # it reads the rows there
    table = next(t for n, t in load_file(str(ckpt / "model.safetensors")).items() if n.endswith("embed_tokens.weight"))
    ids = torch.tensor([0, 5, 383, 17, 5])
    assert torch.equal(emb(ids), table.bfloat16()[ids])

    monkeypatch.setattr(linear, "share_tied_table", lambda model, ops: False)
    dense = LLM(str(ckpt), dtype="bfloat16")  # as before: the table dense, the head packed from it
    assert type(dense.loaded.model.embeddings()) is nn.Embedding
    prompt = shared.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(shared, prompt), _logits(dense, prompt))
    assert _greedy(shared, PROMPTS) == _greedy(dense, PROMPTS)


def test_a_float32_model_keeps_its_table(make_checkpoint: Callable[..., Path]) -> None:
    """float32 weights pack the head as f32, whose rows the lookup does not read: the table stays an nn.Embedding."""
    ckpt = make_checkpoint("qwen2", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    model = LLM(str(ckpt), dtype="float32").loaded.model
    assert type(model.embeddings()) is nn.Embedding

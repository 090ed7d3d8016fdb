"""Pooling models against Hugging Face transformers on tiny random checkpoints made here, in float32 within 1e-4:
embeddings (the final norm's hidden states pooled at the last token or averaged, then normalised; Matryoshka
`dimensions`), sequence-classification scores (the `score` head at the last token, through a sigmoid) and a causal
yes/no reranker's P(yes) under Qwen3-Reranker's prompt. Prompts run in chunks of 8 tokens, so a pooled prompt spans
several steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests import target
from tests.conftest import TINY
from tests.pooling_checkpoints import (
    bare_decoder,
    classifier,
    hf_hidden,
    sentence_transformers,
    yes_no_tokenizer,
)
from tokenmill import LLM, PoolingParams
from tokenmill.engine.scoring import QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX

TOL = 1e-4
TEXTS = [
    "Hello world!",
    "To be, or not to be, that is the question.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "a",
]
CHUNKED = dict(dtype="float32", max_num_batched_tokens=8)  # prompts of up to ~20 tokens: up to 3 steps each


def _llm(folder: Path, **kwargs: Any) -> LLM:
    return LLM(str(folder), **{**CHUNKED, "device": target.DEVICE, **kwargs})


def _hf_base(folder: Path) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()


def _diff(ours: list[float], ref: torch.Tensor) -> float:
    return (torch.tensor(ours) - ref).abs().max().item()


@pytest.fixture(scope="module")
def last_token(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 causal checkpoint with sentence-transformers' files saying last-token pooling (Qwen3-Embedding's)."""
    source = make_checkpoint("qwen3", initializer_range=0.1)
    return sentence_transformers(source, tmp_path_factory.mktemp("st") / "last", "last")


def test_last_token_embeddings_match_transformers(last_token: Path) -> None:
    llm = _llm(last_token)
    assert llm.loaded.task.names == ("embed",) and llm.loaded.task.pooling is not None
    assert llm.loaded.task.pooling.pooling == "last"
    hf = _hf_base(last_token)
    for out in llm.embed(TEXTS):
        ref = F.normalize(hf_hidden(hf, out.prompt_token_ids)[-1], dim=-1)
        assert _diff(out.outputs.embedding, ref) < TOL


def test_dimensions_cut_the_vector_then_normalise_it(last_token: Path) -> None:
    llm = _llm(last_token)
    hf = _hf_base(last_token)
    cut = llm.embed(TEXTS, PoolingParams(dimensions=16))
    raw = llm.embed(TEXTS, PoolingParams(normalize=False))
    for a, b in zip(cut, raw, strict=True):
        last = hf_hidden(hf, a.prompt_token_ids)[-1]
        assert len(a.outputs.embedding) == 16
        assert _diff(a.outputs.embedding, F.normalize(last[:16], dim=-1)) < TOL
        assert _diff(b.outputs.embedding, last) < TOL


def test_a_gguf_with_a_pooling_type_embeds_as_its_folder_does(last_token: Path, tmp_path: Path) -> None:
    """The exporter writes the folder's pooling as llama.cpp's converter does (`qwen3.pooling_type`), which says
    embed."""
    from tokenmill.bench.gguf_export import export_gguf

    llm = _llm(export_gguf(last_token, tmp_path / "embedder.gguf", "f32"))
    assert llm.loaded.task.names == ("embed",)
    for ours, ref in zip(llm.embed(TEXTS), _llm(last_token).embed(TEXTS), strict=True):
        assert ours.prompt_token_ids == ref.prompt_token_ids
        assert _diff(ours.outputs.embedding, torch.tensor(ref.outputs.embedding)) < TOL


def test_mean_pooled_embeddings_match_transformers(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    folder = sentence_transformers(make_checkpoint("llama", initializer_range=0.1), tmp_path / "mean", "mean")
    llm = _llm(folder)
    assert llm.loaded.task.pooling is not None and llm.loaded.task.pooling.pooling == "mean"
    hf = _hf_base(folder)
    first, again = llm.embed(TEXTS), llm.embed(TEXTS)  # the second: every prompt's blocks are in the prefix cache
    for a, b in zip(first, again, strict=True):
        ref = F.normalize(hf_hidden(hf, a.prompt_token_ids).mean(0), dim=-1)
        assert _diff(a.outputs.embedding, ref) < TOL
        assert _diff(b.outputs.embedding, ref) < TOL


@pytest.mark.parametrize("kv_cache", ["contiguous", "none"])
def test_mean_pooling_in_the_other_kv_backends(
    make_checkpoint: Callable[..., Path], tmp_path: Path, kv_cache: str
) -> None:
    """One buffer per sequence, or no cache (every step recomputes from the first token: no chunks)."""
    folder = sentence_transformers(make_checkpoint("llama", initializer_range=0.1), tmp_path / "mean", "mean")
    hf = _hf_base(folder)
    for out in _llm(folder, kv_cache=kv_cache).embed(TEXTS):
        assert _diff(out.outputs.embedding, F.normalize(hf_hidden(hf, out.prompt_token_ids).mean(0), dim=-1)) < TOL


def test_a_bare_decoder_checkpoint_embeds_as_qwen3_embedding_is_saved(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Saved from `Qwen3Model`: tensors without the `model.` prefix and no LM head. Its own architecture name says
    embed; renamed to Qwen3ForCausalLM with sentence-transformers' files (Qwen3-Embedding's layout), it embeds too."""
    import json
    import shutil

    folder = bare_decoder("qwen3", tokenizer_dir, tmp_path / "bare")
    hf = _hf_base(folder)
    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed / "src")
    config = json.loads((renamed / "src" / "config.json").read_text())
    (renamed / "src" / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    like_qwen3_embedding = sentence_transformers(renamed / "src", renamed / "st", "last")
    for checkpoint in (folder, like_qwen3_embedding):
        llm = _llm(checkpoint)
        assert llm.loaded.task.names == ("embed",)
        for out in llm.embed(TEXTS[:2]):
            ref = F.normalize(hf_hidden(hf, out.prompt_token_ids)[-1], dim=-1)
            assert _diff(out.outputs.embedding, ref) < TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sequence_classification_scores_match_transformers(arch: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = classifier(arch, tokenizer_dir, tmp_path / arch)
    llm = _llm(folder)
    assert llm.loaded.task.pooling is not None and llm.loaded.task.pooling.head == "classifier"
    hf = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    query, docs = TEXTS[0], TEXTS[1:]
    for doc, out in zip(docs, llm.score(query, docs), strict=True):
        encoded = tok(query, doc, return_tensors="pt")
        assert out.prompt_token_ids == encoded.input_ids[0].tolist()
        with torch.no_grad():
            ref = hf(**encoded).logits[0, 0].sigmoid().item()
        assert abs(out.outputs.score - ref) < TOL


def test_yes_no_reranker_matches_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Qwen3-Reranker's recipe: its prompt, then softmax over the "no" and "yes" logits at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.make_model import hf_config, write_checkpoint

    tok_dir = yes_no_tokenizer(tokenizer_dir, tmp_path / "tok")
    folder = write_checkpoint(hf_config("qwen3", **{**TINY, "vocab_size": 400, "initializer_range": 0.1}), tok_dir,
                              tmp_path / "reranker")  # fmt: skip
    llm = _llm(folder, task="rerank")
    assert llm.loaded.task.names == ("score",)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    query, docs, instruction = "What is the question?", TEXTS, "Judge the relevance"
    for doc, out in zip(docs, llm.score(query, docs, instruction=instruction), strict=True):
        body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
        ids = [t for part in (QWEN3_RERANKER_PREFIX, body, QWEN3_RERANKER_SUFFIX)
               for t in tok.encode(part, add_special_tokens=False)]  # fmt: skip
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        ref = torch.stack([last[no], last[yes]]).log_softmax(-1)[1].exp().item()
        assert abs(out.outputs.score - ref) < TOL

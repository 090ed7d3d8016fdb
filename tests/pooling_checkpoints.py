"""Tiny pooling checkpoints for the tests, made from the session's random ones (tests/conftest.py): a
sentence-transformers folder (modules.json + 1_Pooling), a bare decoder saved as Qwen3-Embedding is, a
sequence-classification model, and a tokenizer with "yes" and "no" for a Qwen3-Reranker-style causal reranker; and the
transformers references they are compared with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.conftest import TINY

ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens"}


def sentence_transformers(source: Path, out: Path, mode: str) -> Path:
    """A copy of checkpoint `source` with sentence-transformers' files declaring `mode` pooling and normalisation."""
    shutil.copytree(source, out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    flags = {flag: name == mode for name, flag in ST_MODES.items()}
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    return out


def bare_decoder(arch: str, tokenizer_dir: Path, out: Path, **overrides: Any) -> Path:
    """A checkpoint saved from the decoder alone (`Qwen3Model`): no LM head, no `model.` prefix on its tensors."""
    from transformers import AutoModel, AutoTokenizer

    from tokenmill.make_model import hf_config

    torch.manual_seed(0)
    model = AutoModel.from_config(hf_config(arch, **{**TINY, "initializer_range": 0.1, **overrides}))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)
    return out


def classifier(arch: str, tokenizer_dir: Path, out: Path) -> Path:
    """A `*ForSequenceClassification` with one label, random weights, saved with its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tokenmill.make_model import hf_config

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = hf_config(arch, **{**TINY, "initializer_range": 0.1}, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def yes_no_tokenizer(tokenizer_dir: Path, out: Path) -> Path:
    """The test tokenizer with "yes" and "no" as tokens of their own (a real Qwen tokenizer has them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_tokens(["yes", "no"])
    tok.save_pretrained(out)
    return out


def hf_hidden(model: Any, ids: list[int]) -> torch.Tensor:  # [T, D] float32: the final norm's output
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].float()

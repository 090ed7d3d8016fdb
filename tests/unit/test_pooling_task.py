"""What a checkpoint is served for (assembly/task.py): `--task` as given, or what the checkpoint says, and the
one-line refusals where it cannot serve that. Config dicts and folders only: no weights are read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.assembly.task import resolve_task
from tokenmill.config import EngineConfig, parse_task
from tokenmill.errors import ConfigError
from tokenmill.pooling_params import ModelTask, PoolingConfig, PoolingParams
from tokenmill.tokenizer import Tokenizer

CAUSAL = {"architectures": ["Qwen3ForCausalLM"]}


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


def _folder(tmp_path: Path, pooling: dict[str, bool] | None = None, extra_module: str | None = None) -> Path:
    """A folder with sentence-transformers' files (none without `pooling`)."""
    if pooling is None:
        return tmp_path
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if extra_module:
        modules.append({"path": "2", "type": f"sentence_transformers.models.{extra_module}"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def _task(requested: str, hf: dict[str, Any], folder: Path, tok: Tokenizer) -> ModelTask:
    return resolve_task(requested, folder, hf, None, tok)


def test_auto_reads_the_architecture_then_sentence_transformers_files(tmp_path: Path, tok: Tokenizer) -> None:
    assert _task("auto", CAUSAL, tmp_path, tok) == ModelTask()
    bare = _task("auto", {"architectures": ["Qwen3Model"]}, tmp_path, tok)
    assert bare == ModelTask(generate=False, pooling=PoolingConfig("embed", "last"))
    cls = _task("auto", {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}}, tmp_path,
                tok)  # fmt: skip
    assert cls.pooling == PoolingConfig("score", "last", "classifier", 1, "sigmoid")
    mean = _task("auto", CAUSAL, _folder(tmp_path, {"pooling_mode_mean_tokens": True}), tok)
    assert not mean.generate and mean.pooling == PoolingConfig("embed", "mean")


def test_explicit_tasks(tmp_path: Path, tok: Tokenizer) -> None:
    assert _task("embed", CAUSAL, tmp_path, tok).pooling == PoolingConfig("embed", "last")
    both = _task("generate,embed", {**CAUSAL, "matryoshka_dimensions": [32, 64]}, tmp_path, tok)
    assert both.generate and both.names == ("generate", "embed")
    assert both.pooling is not None and both.pooling.matryoshka_dimensions == (32, 64)
    assert _task("generate", {"architectures": ["Qwen3ForCausalLM"]}, _folder(tmp_path, {}), tok) == ModelTask()
    identity = {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "x"},
                "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}  # fmt: skip
    assert _task("rerank", identity, tmp_path, tok).pooling == PoolingConfig("score", "last", "classifier", 1,
                                                                             "identity")  # fmt: skip


REFUSED: list[tuple[str, dict[str, Any], dict[str, bool] | None, str | None, str]] = [
    ("generate", {"architectures": ["Qwen3ForSequenceClassification"]}, None, None, "no LM head"),
    ("score", {"architectures": ["Qwen3Model"]}, None, None, "bare decoder"),
    ("auto", {"architectures": ["LlamaForSequenceClassification"]}, None, None, "2 labels"),
    ("auto", CAUSAL, {"pooling_mode_weightedmean_tokens": True}, None, "pooling_mode_weightedmean_tokens"),
    ("auto", CAUSAL, {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True}, None, "exactly one"),
    ("auto", CAUSAL, {"pooling_mode_lasttoken": True}, "Dense", "Dense"),
    ("score", CAUSAL, None, None, "no single token 'no'"),  # the test tokenizer has neither "yes" nor "no"
    ("auto", {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "x"},
              "sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, None, None, "Tanh"),
]  # fmt: skip


@pytest.mark.parametrize(("requested", "hf", "pooling", "module", "message"), REFUSED,
                         ids=[r[-1] for r in REFUSED])  # fmt: skip
def test_what_cannot_be_served_is_one_clear_error(
    tmp_path: Path, tok: Tokenizer, requested: str, hf: dict[str, Any], pooling: dict[str, bool] | None,
    module: str | None, message: str,
) -> None:  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        _task(requested, hf, _folder(tmp_path, pooling, module), tok)


def test_task_values() -> None:
    assert parse_task("rerank") == {"score"} and parse_task("generate, embed") == {"generate", "embed"}
    for bad in ("classify", "auto,embed", "embed,score", ""):
        with pytest.raises(ValueError, match="task="):
            EngineConfig(task=bad)
    with pytest.raises(ValueError, match="task generate"):
        EngineConfig(task="embed", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(task="score", dimensions=8)

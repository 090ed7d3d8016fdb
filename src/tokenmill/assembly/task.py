"""Which tasks a checkpoint is served for (`--task`, or what the checkpoint says), and how it pools.

`--task auto` (the default) decides from the checkpoint, in this order, and nothing else (no file or folder names):
1. an architecture in `models.pooling.POOLING_ARCHITECTURES`: `*ForSequenceClassification` scores, a bare decoder
   (`Qwen3Model`, `MistralModel`, ...) embeds;
2. a sentence-transformers folder (`modules.json` naming a Pooling module, as Qwen3-Embedding's) embeds;
3. a GGUF whose metadata names a pooling type (`{arch}.pooling_type`, as llama.cpp's converter writes for
   embedding models) embeds;
4. anything else generates.

An explicit `--task` serves what it names where the checkpoint can: `embed` on any causal LM (last-token pooling
unless its sentence-transformers or GGUF pooling says mean); `score` on a `*ForSequenceClassification` (its `score`
head) or on a causal LM as a Qwen3-Reranker-style yes/no reranker; `generate,embed` (or `generate,score`) serves both
from one causal LM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.config import parse_task
from tokenmill.errors import ConfigError
from tokenmill.models.pooling import POOLING_ARCHITECTURES
from tokenmill.pooling_params import Activation, ModelTask, PoolingConfig, PoolingType
from tokenmill.tokenizer import Tokenizer
from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint

# sentence-transformers' 1_Pooling/config.json flags -> our pooling (the others are refused by name)
_ST_POOLING: dict[str, PoolingType] = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_GGUF_POOLING: dict[int, PoolingType] = {1: "mean", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_MEAN, _LAST
# a cross-encoder's activation named in its config (sentence-transformers), as vLLM reads it
_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


def resolve_task(
    requested: str, path: Path, hf: dict[str, Any], gguf: GGUFCheckpoint | None, tokenizer: Tokenizer
) -> ModelTask:
    """What the checkpoint at `path` (its config.json `hf`) is served for under `--task requested`; ConfigError where
    it cannot serve that."""
    names = parse_task(requested)
    arch = str((hf.get("architectures") or [""])[0])
    made_for = POOLING_ARCHITECTURES[arch][1] if arch in POOLING_ARCHITECTURES else None
    declared = None  # the pooling the checkpoint names, read only where it decides something
    if names == {"auto"} or "embed" in names:
        declared = _gguf_pooling(gguf) if gguf is not None else sentence_transformers_pooling(path)
    if names == {"auto"}:
        detected = made_for or ("embed" if declared else None)
        names = frozenset({detected or "generate"})
    if "generate" in names and made_for is not None:
        raise ConfigError(f"{arch} has no LM head: it cannot generate; serve it with --task {made_for}")
    task = next((n for n in names if n != "generate"), None)
    if task is None:
        return ModelTask()
    if task == "embed":
        dims = tuple(int(d) for d in hf.get("matryoshka_dimensions") or ())
        pooling = PoolingConfig("embed", declared or "last", matryoshka_dimensions=dims)
    elif made_for == "score":
        pooling = _classifier(arch, hf)
    elif made_for == "embed":
        raise ConfigError(f"{arch} is a bare decoder with no head to score with; serve it with --task embed")
    else:
        pooling = PoolingConfig("score", "last", "yes_no", token_ids=_yes_no_ids(tokenizer))
    return ModelTask(generate="generate" in names, pooling=pooling)


def _classifier(arch: str, hf: dict[str, Any]) -> PoolingConfig:
    """A sequence-classification head's config: one label (a score, as vLLM's score API needs), its activation."""
    labels = hf.get("id2label")
    num_labels = int(hf.get("num_labels") or (len(labels) if isinstance(labels, dict) else 2))
    if num_labels != 1:
        raise ConfigError(f"{arch} has {num_labels} labels; scoring needs a head of one (num_labels=1), whose "
                          "sigmoid is the score")  # fmt: skip
    st = hf.get("sentence_transformers")
    named = (st.get("activation_fn") if isinstance(st, dict) else None) or hf.get(
        "sbert_ce_default_activation_function"
    )
    if named is not None and named not in _ACTIVATIONS:
        raise ConfigError(f"config.json names the activation {named!r}; supported: {', '.join(_ACTIVATIONS)}")
    return PoolingConfig("score", "last", "classifier", num_labels, _ACTIVATIONS.get(named or "", "sigmoid"))


def _yes_no_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of "no" and "yes", whose logits a causal reranker compares (Qwen3-Reranker's)."""
    ids = []
    for word in ("no", "yes"):
        found = tokenizer.token_to_id(word)
        if found is None:
            pieces = tokenizer.encode(word, add_special_tokens=False)
            found = pieces[0] if len(pieces) == 1 else None
        if found is None:
            raise ConfigError(f"--task score on a causal LM reads the logits of 'yes' and 'no' (as Qwen3-Reranker); "
                              f"this tokenizer has no single token {word!r}")  # fmt: skip
        ids.append(found)
    return ids[0], ids[1]


def sentence_transformers_pooling(path: Path) -> PoolingType | None:
    """The pooling a sentence-transformers folder declares (modules.json -> its Pooling module's config.json), or
    None without one. ConfigError for a pooling mode or a module we do not run."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_file} must hold a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    extra = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if extra:
        raise ConfigError(f"{modules_file}: sentence-transformers module {extra[0]} is not supported (only "
                          "Transformer, Pooling and Normalize)")  # fmt: skip
    if "Pooling" not in kinds:
        return None
    config_file = path / str(kinds["Pooling"].get("path", "1_Pooling")) / "config.json"
    config = _json(config_file)
    modes = [k for k, v in config.items() if k.startswith("pooling_mode") and v is True] if isinstance(config, dict) \
        else []  # fmt: skip
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise ConfigError(f"{config_file} turns on pooling {', '.join(modes) or 'none'}; supported: exactly one of "
                          f"{', '.join(_ST_POOLING)}")  # fmt: skip
    return _ST_POOLING[modes[0]]


def _gguf_pooling(gguf: GGUFCheckpoint) -> PoolingType | None:
    """The pooling a GGUF's metadata names (llama.cpp's `{arch}.pooling_type`), or None where it names none."""
    kind = gguf.metadata(f"{gguf.arch}.pooling_type")
    if kind is None or int(kind) == 0:
        return None
    if int(kind) not in _GGUF_POOLING:
        raise ConfigError(f"{gguf.path.name}: pooling type {kind} is not supported; supported: 1 (mean), 3 (last)")
    return _GGUF_POOLING[int(kind)]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}") from None

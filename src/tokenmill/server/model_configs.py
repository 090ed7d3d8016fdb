"""The models `tokenmill serve` is to serve side by side, from `--model NAME=PATH` (repeated) and `--models-config
FILE`: each one's name and engine config. Every mistake is a ValueError whose one line says what was wrong and what
is allowed.

The file is YAML (JSON is YAML too): a mapping whose `models` lists one mapping per model, `name` and `path`
required, and any engine flag of `tokenmill serve` by its name, with `_` or `-` (dtype, quantization,
max_model_len, kv_cache_memory_gb, ...), over the command line's own values:

    models:
      - name: qwen
        path: /models/Qwen2.5-0.5B-Instruct
        dtype: bfloat16
      - name: llama-q4
        path: /models/llama-3.2-1b-q4_k_m.gguf
        max_model_len: 4096
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from tokenmill.config import EngineConfig

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")  # what a model name may be (no spaces, no '=')
_FIELDS = {f.name: f for f in fields(EngineConfig) if f.name != "model"}


def model_configs(base: EngineConfig, flags: list[str], config_file: str | None) -> list[tuple[str, EngineConfig]]:
    """(name, engine config) of every model given, in order: the flags' first, then the file's."""
    entries = [_from_flag(value) for value in flags]
    if config_file is not None:
        entries += _from_file(Path(config_file))
    seen: set[str] = set()
    models = []
    for name, path, overrides, where in entries:
        if name in seen:
            raise ValueError(f"{where}: the model name {name!r} is given twice; each model needs its own name")
        seen.add(name)
        try:
            models.append((name, replace(base, model=path, **overrides)))  # (EngineConfig checks its values)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return models


def _from_flag(value: str) -> tuple[str, str, dict[str, Any], str]:
    name, sep, path = value.partition("=")
    if not sep or not path or not NAME.fullmatch(name):
        raise ValueError(f"--model {value!r} is invalid: allowed NAME=PATH, a name of letters, digits and ._:/- "
                         "and a checkpoint folder, .gguf file or hub id")  # fmt: skip
    return name, path, {}, f"--model {value}"


def _from_file(path: Path) -> list[tuple[str, str, dict[str, Any], str]]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"--models-config {path} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--models-config {path} is not valid YAML/JSON: {' '.join(str(e).split())}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models or set(data) != {"models"}:
        raise ValueError(f"--models-config {path}: allowed one key, `models`, a list of mappings with name, path "
                         "and engine flags")  # fmt: skip
    return [_entry(item, f"--models-config {path}: models[{i}]") for i, item in enumerate(models)]


def _entry(item: Any, where: str) -> tuple[str, str, dict[str, Any], str]:
    if not isinstance(item, dict):
        raise ValueError(f"{where} is a {type(item).__name__}: allowed a mapping with name, path and engine flags")
    item = {str(k).replace("-", "_"): v for k, v in item.items()}
    name, path = item.pop("name", None), item.pop("path", None)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}: name={name!r} is invalid: allowed a string of letters, digits and ._:/-")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where} ({name}): path={path!r} is invalid: allowed a checkpoint folder, .gguf or hub id")
    unknown = sorted(set(item) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where} ({name}): unknown key {unknown[0]!r}; allowed: name, path, {', '.join(_FIELDS)}")
    for key, value in item.items():
        _check_type(key, value, f"{where} ({name})")
    return name, path, item, f"{where} ({name})"


def _check_type(key: str, value: Any, where: str) -> None:
    hint = get_type_hints(EngineConfig)[key]
    kinds = (str,) if get_origin(hint) is Literal else get_args(hint) or (hint,)  # (EngineConfig checks choices)
    if value is None and type(None) in kinds:
        return
    if isinstance(value, bool) != (bool in kinds):  # (a bool is an int to Python; not to a flag)
        ok = False
    else:
        ok = any(isinstance(value, k) for k in kinds if k is not type(None)) or (float in kinds and type(value) is int)
    if not ok:
        allowed = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{where}: {key}={value!r} is invalid: allowed {allowed}")

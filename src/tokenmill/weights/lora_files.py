"""Reading a LoRA adapter folder as peft writes it (`adapter_config.json`, `adapter_model.safetensors`) into an
`Adapter` for a model's adapted projections (models/lora.py): only json and safetensors, no peft.

Everything is checked before anything is installed: the config's features (plain LoRA: no DoRA, biases,
`modules_to_save`, per-module alphas or embedding adapters), every tensor's name and shape against the model's
projections, and the rank against `--max-lora-rank`. Each problem is one ValueError line naming what was wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tokenmill.models.lora import TARGETS, Adapter, AdapterWeights, ProjectionShape

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
# config fields that change what the adapter computes, and the value plain LoRA has (peft's defaults)
_PLAIN = {"use_dora": False, "bias": "none", "modules_to_save": None, "fan_in_fan_out": False, "alpha_pattern": {},
          "lora_bias": False, "use_qalora": False}  # fmt: skip


def read_adapter(
    name: str, path: str, shapes: dict[tuple[int, str], ProjectionShape], max_rank: int
) -> Adapter:  # fmt: skip
    """The adapter in folder `path`, checked against the model's projections `shapes` and `max_rank`."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a folder (expected one holding {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE}, as peft's save_pretrained writes)")  # fmt: skip
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {' or '.join(missing)}")
    config_bytes, weight_bytes = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    config = _config(name, config_bytes)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    digest = hashlib.blake2b(config_bytes + b"\0" + weight_bytes, digest_size=16).digest()
    adapter = Adapter(name, str(folder), 0, int.from_bytes(digest, "little"))
    pairs = _pairs(name, tensors, shapes)
    for (layer, proj), shards in sorted(pairs.items()):
        adapter.weights[layer, proj] = _weights(name, layer, proj, shards, shapes[layer, proj], config, max_rank)
        adapter.rank = max(adapter.rank, max(a.shape[0] for a, _ in shards.values()))
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    return adapter


def _config(name: str, raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {kind!r} is not supported; allowed: LORA")
    for key, plain in _PLAIN.items():
        value = config.get(key, plain)
        if value != plain and not (plain in (None, {}) and not value):
            raise ValueError(f"LoRA adapter {name!r}: {key}={value!r} is not supported (plain LoRA only: "
                             f"{key}={plain!r})")  # fmt: skip
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} has no numeric lora_alpha")
    return config


def _pairs(
    name: str, tensors: dict[str, torch.Tensor], shapes: dict[tuple[int, str], ProjectionShape]
) -> dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]:  # fmt: skip
    """{(layer, projection): {shard: (A [r, D_in], B [D_out, r])}} from the file's tensors."""
    found: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        target = TARGETS.get(m.group(3)) if m else None
        if m is None or target is None or _PARENT[target[0]] != m.group(2):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} adapts a module tokenmill cannot; allowed: "
                             f"lora_A/lora_B of {', '.join(TARGETS)} in the decoder layers")  # fmt: skip
        layer, (proj, shard) = int(m.group(1)), target
        if (layer, proj) not in shapes:
            where = sorted({p for _, p in shapes}) or ["none: this model's family takes no adapters"]
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} targets layer {layer}'s {m.group(3)}, which "
                             f"this model does not have; its adaptable projections: {', '.join(where)} in "
                             f"{len({i for i, _ in shapes})} layers")  # fmt: skip
        found.setdefault((layer, proj, shard), {})[m.group(4)] = tensor
    pairs: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj, shard), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} shard {shard} has lora_{''.join(ab)} "
                             "without its pair")  # fmt: skip
        pairs.setdefault((layer, proj), {})[shard] = (ab["A"].float(), ab["B"].float())
    return pairs


def _weights(
    name: str, layer: int, proj: str, shards: dict[int, tuple[torch.Tensor, torch.Tensor]], shape: ProjectionShape,
    config: dict[str, Any], max_rank: int,
) -> AdapterWeights:  # fmt: skip
    """A projection's stacked A [n*r, D_in] and block-diagonal B [D_out, n*r], checked against its shape."""
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    where = f"LoRA adapter {name!r}: layer {layer} {proj}"
    if -1 in shards and len(shards) > 1:
        raise ValueError(f"{where}: adapts the fused projection and its parts at once")
    scales: dict[int, float] = {}
    for shard, (a, b) in shards.items():
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a rank-r pair")
        want = (shape.in_features, shape.shards[shard] if shard >= 0 else sum(shape.shards))
        if (a.shape[1], b.shape[0]) != want:
            raise ValueError(f"{where} shard {shard}: the adapter maps {a.shape[1]} -> {b.shape[0]} features but "
                             f"this model's projection maps {want[0]} -> {want[1]}: an adapter for another base "
                             "model")  # fmt: skip
        if not 1 <= r <= max_rank:
            raise ValueError(f"{where}: rank {r} exceeds --max-lora-rank {max_rank}; serve with a larger "
                             "--max-lora-rank")  # fmt: skip
        scales[shard] = alpha / (math.sqrt(r) if rslora else r)
    order = sorted(shards)
    scale = scales[order[0]]
    if order == [-1]:  # the whole fused projection (Phi-3's names)
        return AdapterWeights(shards[-1][0], shards[-1][1], scale)
    a_all = torch.cat([shards[s][0] for s in order])  # [n*r, D_in]
    b_all = torch.zeros(sum(shape.shards), a_all.shape[0])  # [D_out, n*r] block-diagonal
    col = 0
    for s in order:
        a, b = shards[s]
        row = sum(shape.shards[:s])
        ratio = scales[s] / scale  # 1 unless ranks differ between shards (rank_pattern)
        b_all[row : row + b.shape[0], col : col + a.shape[0]] = b if ratio == 1 else b * ratio
        col += a.shape[0]
    return AdapterWeights(a_all, b_all, scale)

"""Fill a model built on the meta device straight from the checkpoint's tensors.

Hugging Face names map one to one onto ours except the fused projections: `q_proj|k_proj|v_proj` land in
slices of `qkv_proj`, `gate_proj|up_proj` in slices of `gate_up_proj` (a checkpoint that stores them fused, as
Phi-3's, fills them whole). A family's `hf_transposed` tensors are stored [in, out] and turned around. Every
parameter must be filled exactly once and every checkpoint tensor must land somewhere, so a mismatched
checkpoint fails loudly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.models import CausalLM
from tokenmill.models.layers import STACKED_PARAMS, RotaryEmbedding
from tokenmill.weights.safetensors_io import iter_tensors


def _shard_sizes(cfg: ModelConfig) -> dict[str, list[int]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}


def _map_name(name: str) -> tuple[str, str | None, int]:
    """HF tensor name -> (our parameter name, fused module or None, shard index)."""
    for fused, shards in STACKED_PARAMS.items():
        for hf_part, idx in shards:
            if f".{hf_part}." in name:
                return name.replace(f".{hf_part}.", f".{fused}."), fused, idx
    return name, None, 0


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[attr] = nn.Parameter(value, requires_grad=False)


def load_weights(model: CausalLM, folder: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Fill `model` (built on the meta device) from the safetensors files in `folder`."""
    cfg = model.config
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away here
    shard_sizes = _shard_sizes(cfg)
    filled: dict[str, set[int]] = {}
    for hf_name, tensor, path in iter_tensors(folder):
        if hf_name.endswith(model.hf_ignored) or (cfg.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue
        if hf_name.endswith(model.hf_transposed):  # [in, out] -> [out, in]
            tensor = tensor.t()
        name, fused, shard = _map_name(hf_name)
        if name not in params:
            raise ModelLoadError(
                f"unexpected tensor {hf_name!r} in {path}: {cfg.architecture} has no such weight "
                "(is config.json from a different model?)"
            )
        param = params[name]
        if fused is None:
            expected = tuple(param.shape)
        else:
            sizes = shard_sizes[fused]
            expected = (sizes[shard], *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"tensor {hf_name!r} in {path} has shape {list(tensor.shape)}, but config.json implies {list(expected)}"
            )
        value = tensor.to(device=device, dtype=dtype).contiguous()
        if fused is None:  # a tensor of its own, or a fused one stored whole (Phi-3's qkv_proj, gate_up_proj)
            _set_param(model, name, value)
            whole = next((f for f in STACKED_PARAMS if f".{f}." in name), None)
            filled[name] = {idx for _, idx in STACKED_PARAMS[whole]} if whole else {0}
            continue
        if name not in filled:  # the first shard seen allocates the fused tensor
            _set_param(model, name, torch.empty(param.shape, dtype=dtype, device=device))
            params[name] = model.get_parameter(name)
            filled[name] = set()
        offset = sum(shard_sizes[fused][:shard])
        params[name].data[offset : offset + value.shape[0]].copy_(value)
        filled[name].add(shard)

    missing = []
    for name in params:
        fused = next((f for f in STACKED_PARAMS if f".{f}." in name), None)
        if fused is None:
            missing += [] if name in filled else [name]
            continue
        for hf_part, idx in STACKED_PARAMS[fused]:
            if idx not in filled.get(name, set()):
                missing.append(name.replace(f".{fused}.", f".{hf_part}."))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint {folder} is missing tensor(s): {shown}")

    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embeddings().weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.materialize(device)
    return model.eval()

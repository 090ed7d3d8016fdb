"""What a model will take in memory once loaded (its weights and its KV pool), judged before any weight is read:
a server holding several models (server/models_registry.py) decides from it which to unload before a load.

The weights: a GGUF's tensors as stored; a safetensors checkpoint's files, rescaled from the checkpoint's dtype to
the one it will run in, or to its quantization's bits per weight (ggml's block sizes; the embedding, which stays
unquantized, is counted as quantized too, so a quantized model is judged a little light). The KV pool: as
`plan_num_blocks` will size it. Once a model has loaded, the engine's own count (`AsyncEngine.memory_bytes`)
replaces this.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.assembly.model import read_checkpoint, resolve_device, resolve_dtype
from tokenmill.attention import PagedKVCache, plan_num_blocks
from tokenmill.config import EngineConfig
from tokenmill.models.linear import FORMAT_OF_QUANTIZATION
from tokenmill.weights.safetensors_io import weight_files

_MIXES = {"q4_k_m": "q4_k", "q5_k_m": "q5_k"}  # a recipe's judged by its main type


def estimate_bytes(cfg: EngineConfig) -> int:
    """Bytes of weights and KV pool the model `cfg` names will hold once loaded (reads its config and file sizes)."""
    path, gguf, _, config = read_checkpoint(cfg)
    dtype, device = resolve_dtype(cfg.dtype, config), resolve_device(cfg.device)
    if gguf is not None:
        weights = sum(int(t.n_bytes) for t in gguf.reader.tensors)
    else:
        stored = sum(f.stat().st_size for f in weight_files(path))
        stored_itemsize = getattr(torch, config.torch_dtype, torch.float32).itemsize
        weights = int(stored / stored_itemsize * _bytes_per_weight(cfg.quantization, dtype))
    if cfg.kv_cache != "paged":
        return weights
    max_len = min(cfg.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    blocks = plan_num_blocks(config, replace(cfg, model=str(path)), dtype, device, max_len)
    per_block = PagedKVCache.bytes_per_block(config.num_layers, cfg.block_size, config.num_kv_heads, config.head_dim,
                                             dtype)  # fmt: skip
    return weights + blocks * per_block


def _bytes_per_weight(quantization: str, dtype: torch.dtype) -> float:
    if quantization == "none":
        return float(dtype.itemsize)
    if quantization == "fp8":
        return 1.0  # a float8 byte a weight (and a float32 scale a row)
    fmt = FORMAT_OF_QUANTIZATION[_MIXES.get(quantization, quantization)]  # a ggml block type: q8_0, q4_k, ...
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt.upper()]]
    return type_size / block

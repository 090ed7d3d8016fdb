"""Attention over the KV cache for a flattened batch of sequences (prefills, prefill chunks and decodes).

One protocol (`KVBackend`, protocol.py), three implementations, picked once by name when the engine is built:
`paged` (the default), `contiguous` and `none` (recompute).
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import BatchLayout, attend_sequence
from tokenmill.attention.contiguous import ContiguousKVCache
from tokenmill.attention.kv_quant import storage_dtype
from tokenmill.attention.none import NoKVCache, causal
from tokenmill.attention.paged import PagedKVCache
from tokenmill.attention.protocol import KVBackend
from tokenmill.attention.sizing import plan_num_blocks
from tokenmill.config import KV_CACHE_MODES, EngineConfig
from tokenmill.kernels import FusedOps
from tokenmill.model_config import ModelConfig


def make_kv_backend(
    cfg: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
    ops: FusedOps | None = None,
) -> KVBackend:  # fmt: skip
    """The backend `cfg.kv_cache` names, sized by `cfg` (the paged pool: `plan_num_blocks`)."""
    if cfg.kv_cache == "paged":
        num_blocks = plan_num_blocks(model, cfg, dtype, device, max_model_len)
        paged = PagedKVCache(model.num_layers, num_blocks, cfg.block_size, model.num_kv_heads, model.head_dim, dtype,
                             device, ops, model.layer_windows(), cfg.batch_invariant,
                             storage_dtype(cfg.kv_cache_dtype, dtype))  # fmt: skip
        if cfg.touch_kv_cache:
            paged.touch()
        return paged
    if cfg.kv_cache_dtype != "auto":
        raise ValueError(
            f"--kv-cache-dtype {cfg.kv_cache_dtype} needs the paged KV cache, not --kv-cache {cfg.kv_cache}"
        )
    if cfg.kv_cache == "contiguous":
        return ContiguousKVCache(model.num_layers, model.num_kv_heads, model.head_dim, dtype, device,
                                 model.layer_windows())  # fmt: skip
    if cfg.kv_cache == "none":
        return NoKVCache(model.layer_windows())
    raise ValueError(f"kv_cache={cfg.kv_cache!r} is not supported; allowed: {', '.join(KV_CACHE_MODES)}")


__all__ = [
    "BatchLayout",
    "ContiguousKVCache",
    "KVBackend",
    "NoKVCache",
    "PagedKVCache",
    "attend_sequence",
    "causal",
    "make_kv_backend",
    "plan_num_blocks",
]

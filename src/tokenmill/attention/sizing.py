"""How many blocks the paged KV pool gets (`plan_num_blocks`), once, when the engine is built.

Explicit options win: `--num-kv-blocks`, then `--kv-cache-memory-gb`. Otherwise:
- on the CPU the pool holds what the server is asked to hold, as llama-server's `-c` sizes its cache: with
  `--max-model-len L`, `--max-num-seqs` sequences of L tokens each (vLLM's max_model_len x max_num_seqs); without
  it, a default total context of the model's trained context but at least `DEFAULT_CONTEXT_TOKENS`, shared by
  the running sequences (llama-server's default: `-c` from the model), and never more than `--max-num-seqs`
  full-length sequences. Never more than the cap, min(25% of the available RAM, 4 GiB) (vLLM's CPU default);
  under the cap, never less than one request of the model's full length.
- on a GPU, 80% of the free memory after the weights, but no more than `--max-num-seqs` full-length sequences.
"""

from __future__ import annotations

import torch

from tokenmill.attention.kv_quant import storage_dtype
from tokenmill.attention.paged import PagedKVCache
from tokenmill.config import EngineConfig
from tokenmill.model_config import ModelConfig

# the default total context without --max-model-len, when the model's own is shorter: a short-context model
# (GPT-2's 1024 tokens) still runs many short sequences side by side
DEFAULT_CONTEXT_TOKENS = 32768
CPU_RAM_SHARE = 0.25  # of the available RAM, at most ...
CPU_MAX_BYTES = 4 * 2**30  # ... this (vLLM's VLLM_CPU_KVCACHE_SPACE default)
GPU_FREE_SHARE = 0.8  # of the free GPU memory after the weights


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def available_memory() -> int:
    """The RAM available to new allocations, in bytes (the CPU cap's probe; tests replace it)."""
    import psutil

    return int(psutil.virtual_memory().available)


def context_blocks(block_size: int, max_model_len: int, max_num_seqs: int, max_model_len_given: bool) -> int:
    """The blocks for what the server is asked to hold: `max_num_seqs` sequences of `max_model_len` tokens when
    the user gave max_model_len; otherwise the default total context, max(max_model_len, DEFAULT_CONTEXT_TOKENS),
    but never more than `max_num_seqs` full-length sequences. Always at least one full-length sequence."""
    full_length = max_num_seqs * blocks_for(max_model_len, block_size)
    if max_model_len_given:
        return full_length
    return min(full_length, blocks_for(max(max_model_len, DEFAULT_CONTEXT_TOKENS), block_size))


def cpu_cap_blocks(bytes_per_block: int, available: int) -> int:
    """The most blocks a default CPU pool gets: min(25% of `available`, 4 GiB) of them."""
    return int(min(CPU_RAM_SHARE * available, CPU_MAX_BYTES) // bytes_per_block)


def plan_num_blocks(
    model: ModelConfig, engine: EngineConfig, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> int:
    """How many KV blocks to allocate for `model` in `dtype` on `device`, serving sequences of up to
    `max_model_len` tokens (the resolved one; `engine.max_model_len` is None when the user gave none)."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    block_size = engine.block_size
    storage = storage_dtype(engine.kv_cache_dtype, dtype)
    per_block = PagedKVCache.bytes_per_block(model.num_layers, block_size, model.num_kv_heads, model.head_dim, storage)
    if engine.kv_cache_memory_gb is not None:
        return max(1, int(engine.kv_cache_memory_gb * 2**30 // per_block))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        full_length = engine.max_num_seqs * blocks_for(max_model_len, block_size)
        return max(1, min(int(GPU_FREE_SHARE * free // per_block), full_length))
    wanted = context_blocks(block_size, max_model_len, engine.max_num_seqs, engine.max_model_len is not None)
    return max(1, min(wanted, cpu_cap_blocks(per_block, available_memory())))

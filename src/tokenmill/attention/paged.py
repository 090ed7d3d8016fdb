"""The paged KV store: per layer, one tensor of `num_blocks * block_size` token slots.

Which slots a sequence owns is the KV cache manager's business (pure Python, `kv_cache/`); the runner
turns its block tables into `slot_mapping` (where each new token's keys go) and `context_slots` (where a
sequence's whole context is) before the step, so attention only indexes.
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata


class PagedKVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)
        # NOTE: empty, not zeros: a slot is always written before any sequence reads it, and untouched pages
        # of a large CPU pool then cost no resident memory.
        self.cache = torch.empty(shape, dtype=dtype, device=device)  # [L, 2, slots, Hkv, D]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        assert meta.slot_mapping is not None
        self.cache[layer, 0].index_copy_(0, meta.slot_mapping, k)
        self.cache[layer, 1].index_copy_(0, meta.slot_mapping, v)

    def read(self, layer: int, seq: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        slots = meta.context_slots[seq]  # [ctx]
        assert slots is not None
        return self.cache[layer, 0, slots].transpose(0, 1), self.cache[layer, 1, slots].transpose(0, 1)

    def zero_blocks(self, start: int, end: int) -> None:
        """Zero blocks [start, end) in every layer, keys and values (once each, before their first use)."""
        self.cache[:, :, start * self.block_size : end * self.block_size].zero_()

    def read_blocks(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables [B, M] -> keys, values [B, M * block_size, Hkv, Dh]: whole blocks, one gather each."""
        b, m = block_tables.shape
        flat = block_tables.reshape(-1)
        kv = self.cache[layer].view(2, self.num_blocks, self.block_size, *self.cache.shape[-2:])
        keys = kv[0].index_select(0, flat).view(b, m * self.block_size, *self.cache.shape[-2:])
        values = kv[1].index_select(0, flat).view(b, m * self.block_size, *self.cache.shape[-2:])
        return keys, values

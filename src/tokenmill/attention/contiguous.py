"""The simple KV store: one contiguous buffer per sequence, sized for its whole life when it starts."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata


class ContiguousKVStore:
    """Per-sequence buffers of shape [num_layers, 2, num_kv_heads, max_len, head_dim]."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self._buffers: dict[int, torch.Tensor] = {}

    def allocate(self, slot: int, max_len: int) -> None:
        shape = (self.num_layers, 2, self.num_kv_heads, max_len, self.head_dim)
        self._buffers[slot] = torch.empty(shape, dtype=self.dtype, device=self.device)

    def free(self, slot: int) -> None:
        self._buffers.pop(slot, None)

    @property
    def num_allocated(self) -> int:
        return len(self._buffers)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        for b in range(meta.num_seqs):
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            pos = meta.seq_lens[b] - (end - start)  # first new position
            buf = self._buffers[meta.slots[b]][layer]  # [2, Hkv, max_len, D]
            buf[0, :, pos : pos + end - start] = k[start:end].transpose(0, 1)
            buf[1, :, pos : pos + end - start] = v[start:end].transpose(0, 1)

    def read(self, layer: int, seq: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self._buffers[meta.slots[seq]][layer]
        return buf[0, :, : meta.seq_lens[seq]], buf[1, :, : meta.seq_lens[seq]]

"""The simple KV store: one contiguous buffer per sequence, sized for its whole life when it starts."""

from __future__ import annotations

import torch


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

    def capacity(self, slot: int) -> int:
        return self._buffers[slot].shape[3]

    @property
    def num_allocated(self) -> int:
        return len(self._buffers)

    def bytes_allocated(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        buf = self._buffers[slot][layer]  # [2, Hkv, max_len, D]
        n = k.shape[0]
        buf[0, :, start : start + n] = k.transpose(0, 1)
        buf[1, :, start : start + n] = v.transpose(0, 1)

    def read(self, layer: int, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self._buffers[slot][layer]
        return buf[0, :, :end], buf[1, :, :end]

"""The simple KV store (`--kv-cache contiguous`): one buffer per sequence, sized for its whole life when it
first runs, freed when it finishes. No blocks, no sharing; every sequence attends on its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import BatchLayout, attend_sequence, window_of
from tokenmill.types import SequenceInput


@dataclass
class ContiguousMetadata(BatchLayout):
    request_ids: list[str]


class ContiguousKVCache:
    """Per-sequence buffers of shape [num_layers, 2, num_kv_heads, max_len, head_dim]."""

    retains_kv = True
    uses_blocks = False
    num_blocks = 0
    paged = None  # no block pool: the decode stack and CUDA graphs do not apply

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: Sequence[int | None] = (),
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.windows = list(windows)  # per layer attention window (None: whole context); empty: none anywhere
        self.dtype, self.device = dtype, device
        self._buffers: dict[str, torch.Tensor] = {}

    def prepare(self, sequences: Sequence[SequenceInput], num_decodes: int) -> ContiguousMetadata:
        for s in sequences:
            if s.request_id not in self._buffers:
                shape = (self.num_layers, 2, self.num_kv_heads, s.max_num_tokens, self.head_dim)
                self._buffers[s.request_id] = torch.empty(shape, dtype=self.dtype, device=self.device)
        layout = BatchLayout.of(sequences)
        return ContiguousMetadata(layout.query_start_loc, layout.seq_lens, [s.request_id for s in sequences])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: ContiguousMetadata) -> None:
        for b in range(meta.num_seqs):
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            pos = meta.seq_lens[b] - (end - start)  # first new position
            buf = self._buffers[meta.request_ids[b]][layer]  # [2, Hkv, max_len, Dh]
            buf[0, :, pos : pos + end - start] = k[start:end].transpose(0, 1)
            buf[1, :, pos : pos + end - start] = v[start:end].transpose(0, 1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ContiguousMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(q)
        for b in range(meta.num_seqs):
            start, end, ctx = meta.query_start_loc[b], meta.query_start_loc[b + 1], meta.seq_lens[b]
            if end - start == ctx:  # a fresh prefill attends to its new keys directly
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                buf = self._buffers[meta.request_ids[b]][layer]
                keys, values = buf[0, :, :ctx], buf[1, :, :ctx]  # [Hkv, ctx, Dh]
            out[start:end] = attend_sequence(q[start:end], keys, values, window_of(self.windows, layer), sinks)
        return out

    def release(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

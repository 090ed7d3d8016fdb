"""No KV cache (`--kv-cache none`): every step recomputes each sequence's whole context, the textbook
baseline that shows what a cache buys. Also the plain causal forward that quality scoring and tests use."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.attention.backend import BatchLayout, attend_sequence, window_of
from tokenmill.types import SequenceInput


class NoKVCache:
    retains_kv = False
    uses_blocks = False
    num_blocks = 0
    paged = None  # no block pool: the decode stack and CUDA graphs do not apply

    def __init__(self, windows: Sequence[int | None] = ()) -> None:
        self.windows = list(windows)  # per layer attention window (None: whole context); empty: none anywhere

    def prepare(self, sequences: Sequence[SequenceInput], num_decodes: int) -> BatchLayout:
        return BatchLayout.of(sequences)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: BatchLayout) -> None:
        pass

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchLayout,
               sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(q)
        for b in range(meta.num_seqs):
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            assert end - start == meta.seq_lens[b], "without a KV cache every step must carry the whole context"
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)  # [Hkv, ctx, Dh]
            out[start:end] = attend_sequence(q[start:end], keys, values, window_of(self.windows, layer), sinks)
        return out

    def release(self, request_id: str) -> None:
        pass


def causal(num_tokens: int, windows: Sequence[int | None] = ()) -> tuple[NoKVCache, BatchLayout]:
    """(backend, metadata) for one sequence of `num_tokens` tokens attending causally: `model(ids, pos, *causal(n))`.
    Pass the model's `config.layer_windows()` for a model with sliding-window layers."""
    return NoKVCache(windows), BatchLayout([0, num_tokens], [num_tokens])

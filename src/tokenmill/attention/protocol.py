"""The KV backend protocol.

A KV backend owns where keys and values live between steps and how a batch attends over them. It has three
calls, made in this order:
- `prepare(sequences, num_decodes)` once per step, before the model runs: turn the batch description into
  the backend's own metadata (tensors, plus host-side offsets for the per-sequence loop);
- `write(layer, k, v, meta)` in each attention layer: store the batch's new keys and values;
- `attend(layer, q, k, v, meta)` right after: each sequence's new queries attend to its whole context.
`release(request_id)` forgets a finished request. The runner and the core never ask which backend is in use;
the facts they need are attributes: `retains_kv` (False: every step recomputes the whole context),
`uses_blocks` with `num_blocks` (the scheduler must account for that many KV blocks) and `paged` (the block
pool as tensors, which the decode stack and CUDA graphs read and write in place; None where there is none).

The batch is "token-centric": sequence b contributes `query_start_loc[b+1] - query_start_loc[b]` new tokens
and, after this step, has `seq_lens[b]` tokens of context (cached + new). A prefill, a prefill chunk and a
decode are the same thing with different numbers. The runner puts one-token sequences first (`num_decodes` of
them) so a backend can batch them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenmill.types import SequenceInput

if TYPE_CHECKING:
    from tokenmill.attention.paged import PagedKVCache


class KVBackend(Protocol):
    retains_kv: bool
    uses_blocks: bool
    num_blocks: int  # blocks in the pool when `uses_blocks`, else 0

    @property
    def paged(self) -> PagedKVCache | None:
        """The block pool, for the forward paths that read it in place; None: this backend keeps none."""
        ...

    def prepare(self, sequences: Sequence[SequenceInput], num_decodes: int) -> Any:
        """This step's metadata. The first `num_decodes` sequences have one new token each."""
        ...

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: Any) -> None:
        """Store the batch's new keys/values (each [T, num_kv_heads, head_dim])."""
        ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """q [T, H, Dh] (and the new k/v [T, Hkv, Dh]) -> [T, H, Dh]: each sequence over its whole context. `sinks`
        [H] float32: each head's sink logit in the softmax's denominator (gpt-oss; attention/sinks.py)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        ...

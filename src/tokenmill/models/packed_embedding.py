"""A token embedding kept in a linear's panels: a GGUF's token_embd (Q8_0, Q4_0, the K family) packed once as
the kernels pack a linear's weight, or a tied LM head's bf16 panels (models/linear.py: share_tied_table), each
looked-up row unpacked on the fly (kernels: unpack_rows). A bf16 table of Qwen2.5-1.5B's 151936 x 1536 would take
467 MB beside the file's 150-250, or beside the head's own copy; a tied LM head multiplies by the very same panels.
The decode stack reads its rows itself (stack/stack.h: set_packed_embedding)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import Kernels, formats


class PackedEmbedding(nn.Module):
    data: torch.Tensor

    def __init__(self, packed: formats.PackedWeight, dtype: torch.dtype, ops: Kernels) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padded_dim = (
            packed.out_features,
            packed.in_features,
            packed.padded_in,
        )
        self.format, self.format_id, self.dtype, self.ops = packed.format, packed.format_id, dtype, ops
        self.register_buffer("data", packed.data)  # uint8 panels, shared with a tied LM head

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.format} blocks"

    def dense(self) -> nn.Embedding:
        """The table in the model dtype (where the kernels are not to run: `--no-cpu-kernels`)."""
        packed = formats.PackedWeight(self.data, self.format, self.num_embeddings, self.embedding_dim, self.padded_dim)
        table = formats.unpack(packed).to(self.dtype)  # [V, D]
        return nn.Embedding(self.num_embeddings, self.embedding_dim, _weight=table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., D] in the model dtype
        rows = self.ops.unpack_rows(self.data, self.format_id, self.num_embeddings, self.padded_dim, ids)
        return rows[:, : self.embedding_dim].to(self.dtype).view(*ids.shape, self.embedding_dim)

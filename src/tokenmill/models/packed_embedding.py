"""A token embedding kept in a linear's panels: a GGUF's token_embd (Q8_0, Q4_0, the K family) packed once as
the kernels pack a linear's weight, or a tied LM head's bf16 panels (share_tied_table, below), each
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


def share_tied_table(model: nn.Module, ops: Kernels | None) -> bool:
    """A tied LM head packed in bf16 holds the token table's very values, so the embedding looks its rows up in the
    head's panels and its own dense table goes: a bf16 model kept both (Qwen2.5-0.5B: 260 MB twice). True where it
    swapped (models/linear.py: prepare_linears, once the head is packed)."""
    config, pack_of = getattr(model, "config", None), getattr(getattr(model, "lm_head", None), "packed", None)
    packed = pack_of() if callable(pack_of) else None
    if ops is None or not getattr(config, "tie_word_embeddings", False) or not isinstance(packed, formats.PackedWeight):
        return False
    embeddings = getattr(model, "embeddings", None)
    emb = embeddings() if callable(embeddings) else None
    if type(emb) is not nn.Embedding or packed.format != "bf16" or emb.weight.dtype != torch.bfloat16:
        return False
    if tuple(emb.weight.shape) != (packed.out_features, packed.in_features) or emb.weight.device.type != "cpu":
        return False
    name = next(n for n, m in model.named_modules() if m is emb)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, PackedEmbedding(packed, torch.bfloat16, ops))
    return True

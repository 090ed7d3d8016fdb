"""Attention for a flattened batch: each sequence's new tokens attend to its whole context.

The batch is "token-centric": sequence b contributes `query_start_loc[b+1] - query_start_loc[b]` new tokens
and, after this step, has `seq_lens[b]` tokens of context (cached + new). A prefill, a prefill chunk and a
decode are the same thing with different numbers. The keys and values of every new token in the batch are
written to the KV store first (so a sequence may read blocks another sequence fills in this very step),
then each sequence reads its context back. With no store (`kv_cache="none"`) the context is just the new
tokens.

Two paths:
- decodes (the first `num_decodes` sequences, one new token each, paged store only): one batched call. The
  store gathers every decode sequence's blocks at once into [B, S, Hkv, Dh] (S = the longest context, padded),
  and the H query heads are grouped per KV head ([B, Hkv, H/Hkv, Dh]), so GQA needs no repeated keys and a
  padding mask is the only mask.
- everything else (prefills and chunks), one sequence at a time; a sequence with nothing cached attends to its
  new keys directly, without reading them back from the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs about the batch; passed explicitly, never global."""

    query_start_loc: list[int]  # [B+1] offsets of each sequence's new tokens in the flattened batch
    seq_lens: list[int]  # [B] context length after this step (cached + new)
    kv: KVStore | None = None  # None: no cache, the new tokens are the whole context
    slots: list[int] = field(default_factory=list)  # contiguous store: each sequence's buffer
    slot_mapping: torch.Tensor | None = None  # paged store: [T] cache slot of each new token
    context_slots: list[torch.Tensor | None] = field(default_factory=list)  # paged: [ctx] slots per sequence
    num_decodes: int = 0  # the first num_decodes sequences have one new token each (batched path)
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] block ids (padded with 0)
    decode_bias: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]: 0 context, -inf pad

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class KVStore(Protocol):
    """Where keys and values live between steps."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the batch's new keys/values (each [T, num_kv_heads, head_dim])."""
        ...

    def read(self, layer: int, seq: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s whole context: keys and values, each [num_kv_heads, seq_len, head_dim]."""
        ...


@runtime_checkable
class BlockKVStore(KVStore, Protocol):
    """A store that also reads whole blocks: what the batched decode path needs (the paged store)."""

    def read_blocks(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks, each [B, max_blocks * block_size, num_kv_heads, head_dim]."""
        ...


def _causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, ctx_len] bool: query i (absolute position ctx_len - q_len + i) sees keys at positions <= its own."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    return k_pos <= q_pos


def attend(
    layer: int,
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    if meta.kv is not None:
        meta.kv.write(layer, k, v, meta)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_batch(layer, q[:nd], meta)
    for b in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
        q_len, ctx_len = end - start, meta.seq_lens[b]
        if meta.kv is not None and q_len != ctx_len:
            keys, values = meta.kv.read(layer, b, meta)  # [Hkv, ctx, D]
        else:
            assert meta.kv is not None or q_len == ctx_len, "without a KV cache every step must carry the context"
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        queries = q[start:end].transpose(0, 1)  # [H, q_len, D]
        if gqa:  # NOTE: SDPA's fused CPU kernel wants 4-D inputs and equal head counts; else it takes the math path
            group = q.shape[1] // k.shape[1]
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, ctx, D]
        if q_len == 1:
            o = F.scaled_dot_product_attention(queries[None], keys[None], values[None])
        elif q_len == ctx_len:
            o = F.scaled_dot_product_attention(queries[None], keys[None], values[None], is_causal=True)
        else:
            mask = _causal_mask(q_len, ctx_len, q.device)
            o = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=mask)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _decode_batch(layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q: [B, H, Dh], one new token per sequence -> [B, H, Dh], all sequences in one call."""
    assert isinstance(meta.kv, BlockKVStore) and meta.decode_block_tables is not None and meta.decode_bias is not None
    # NOTE: the padding (slots past a sequence's end) holds stale but finite numbers: the runner zeroes every
    # block before its first write (a high-water mark over block ids), so a -inf bias is enough (a NaN there
    # would survive any mask).
    keys, values = meta.kv.read_blocks(layer, meta.decode_block_tables)  # [B, S, Hkv, Dh] each
    b, h, dh = q.shape
    hkv = keys.shape[2]
    queries = q.view(b, hkv, h // hkv, dh)  # [B, Hkv, G, Dh]: a KV head's query heads side by side
    o = F.scaled_dot_product_attention(
        queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=meta.decode_bias
    )  # [B, Hkv, G, Dh]
    return o.reshape(b, h, dh)

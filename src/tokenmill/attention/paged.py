"""The paged KV cache (`--kv-cache paged`, the default): per layer, one tensor of `num_blocks * block_size`
token slots. Which blocks a sequence owns is the KV manager's business (pure Python, `kv_cache/`); the
scheduler hands each sequence's block table to the runner, and `prepare` turns the tables into slot tensors.

Two attention paths:
- decodes (the first `num_decodes` sequences, one new token each): one batched call. With the fused kernels
  (the CPU's, kernels/; the GPU's in Triton, kernels/cuda/), it reads each sequence's blocks where they are.
  Otherwise every decode sequence's blocks are
  gathered at once into [B, S, Hkv, Dh] (S = the longest context, padded), and the H query heads are grouped
  per KV head ([B, Hkv, H/Hkv, Dh]), so GQA needs no repeated keys and a padding bias is the only mask. This
  path reads only tensors from the metadata.
- everything else (prefills and chunks): with the fused kernels, every prefill of the step in one call that reads
  the blocks in place (its new keys and values were written first). Otherwise one sequence at a time; a sequence
  with nothing cached attends to its new keys directly, without reading them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import BatchLayout, attend_sequence, window_of
from tokenmill.attention.kv_quant import QUANTIZED, bytes_per_row, dequantize_rows, quantize_rows
from tokenmill.attention.sinks import attend_with_sinks
from tokenmill.kernels import CudaKernels, FusedOps, Kernels
from tokenmill.types import SequenceInput


@dataclass
class PagedMetadata(BatchLayout):
    slot_mapping: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [T] cache slot of each new token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] block ids (padded with 0)
    decode_bias: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]: 0 context, -inf pad
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> decode_bias, also -inf before it
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64 context lengths (the fused kernel's mask)
    context_slots: list[torch.Tensor | None] = field(default_factory=list)  # per sequence: [ctx] slots to read
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks] the prefills' block ids (fused kernel)
    prefill_seqs: torch.Tensor | None = None  # [P, 3] int64: first row, new tokens, context length (fused kernel)
    prefill_max_rows: int = 0  # the most new tokens of a prefill (the GPU kernel's grid)
    row_tables: torch.Tensor | None = None  # batch-invariant: [T, max_blocks] each row's sequence's block ids
    row_lens: torch.Tensor | None = None  # batch-invariant: [T] int64 each row's context, itself included


class PagedKVCache:
    retains_kv = True
    uses_blocks = True

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: FusedOps | None = None,
        windows: Sequence[int | None] = (),
        batch_invariant: bool = False,
        storage: torch.dtype | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windows = list(windows)  # per layer attention window (None: whole context); empty: none anywhere
        self.dtype, self.device = dtype, device  # the activations' dtype: what attention takes and returns
        self.storage = storage or dtype  # what the pool holds: `dtype`, bfloat16, or int8 / fp8 rows (kv_quant.py)
        quantized = self.storage in QUANTIZED
        # the fused decode attention (kernels/): it reads the blocks in place, no gather and no padding bias; the
        # CPU kernels also read a quantized pool, the GPU's only a pool in the activations' dtype
        fused = ops is not None and device.type == ops.device_type and dtype in ops.dtypes
        fused = fused and (self.storage == dtype or (quantized and isinstance(ops, Kernels)))
        self.ops = ops if fused else None
        # every row, prefill or decode, through the decode kernel, one query at a time: the same sums for a token
        # whatever its batch, chunk or cached prefix (the prefill kernel's tiles sum in another order)
        self.batch_invariant = batch_invariant
        if batch_invariant and not isinstance(self.ops, Kernels):
            raise ValueError("a batch-invariant pool needs the CPU kernels (bfloat16 or float32 on the CPU)")
        # one more block that no table holds, for CUDA graphs' padded rows to write to (and the gather path's)
        spare = 0 if self.ops is not None and device.type == "cpu" else 1
        self.spare_slot = num_blocks * block_size if spare else None
        shape = (num_layers, 2, (num_blocks + spare) * block_size, num_kv_heads, head_dim)
        # NOTE: empty, not zeros: untouched pages of a large CPU pool cost no resident memory. Blocks are zeroed
        # once, before first use (`_zeroed_below`), because the batched decode reads whole blocks, padding included.
        self.cache = torch.empty(shape, dtype=self.storage, device=device)  # [L, 2, slots, Hkv, Dh]
        # a quantized pool's bf16 scales, one per (slot, KV head) row: [L, 2, slots, Hkv]
        self.scales = torch.empty(shape[:4], dtype=torch.bfloat16, device=device) if quantized else None
        self._zeroed_below = 0  # blocks [0, this) have been zeroed
        if self.spare_slot is not None:
            self._zero_slots(self.spare_slot, None)

    @property
    def paged(self) -> PagedKVCache:
        """This backend is a block pool that the decode stack and CUDA graphs read and write in place."""
        return self

    def touch(self) -> None:
        """Zero the whole pool now: its pages become resident, so the process's memory use is known at start
        (the pool is otherwise `torch.empty`, and pages fill in as blocks are first used)."""
        self._zero_slots(0, None)
        self._zeroed_below = self.num_blocks

    def _zero_slots(self, start: int, end: int | None) -> None:
        self.cache[:, :, start:end].zero_()
        if self.scales is not None:
            self.scales[:, :, start:end].zero_()

    @property
    def nbytes(self) -> int:
        """The pool's bytes: its rows, and a quantized pool's scales."""
        return self.cache.nbytes + (0 if self.scales is None else self.scales.nbytes)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """The bytes of one block's keys and values, every layer's, in storage `dtype`."""
        return 2 * num_layers * block_size * num_kv_heads * bytes_per_row(head_dim, dtype)

    def _layer_scales(self, layer: int) -> torch.Tensor | None:
        return None if self.scales is None else self.scales[layer]

    def _blocks(self, layer: int, half: int, blocks: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s keys (half 0) or values (1) of blocks `blocks` [N] -> [N, bs, Hkv, Dh] in the activations'
        dtype: only these blocks are widened."""
        bs, shape = self.block_size, self.cache.shape[-2:]
        rows = self.cache[layer, half].view(-1, bs, *shape).index_select(0, blocks)
        if self.scales is None:
            return rows.to(self.dtype)
        scales = self.scales[layer, half].view(-1, bs, shape[0]).index_select(0, blocks)
        return dequantize_rows(rows, scales, self.dtype)

    def _rows(self, layer: int, half: int, index: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s keys (half 0) or values (1) at slots `index` [N] -> [N, Hkv, Dh] in the activations'
        dtype: only these rows are widened."""
        rows = self.cache[layer, half].index_select(0, index)
        if self.scales is None:
            return rows.to(self.dtype)
        return dequantize_rows(rows, self.scales[layer, half].index_select(0, index), self.dtype)

    # -- per step ---------------------------------------------------------------------------------------------
    def prepare(self, sequences: Sequence[SequenceInput], num_decodes: int) -> PagedMetadata:
        layout = BatchLayout.of(sequences)
        meta = PagedMetadata(layout.query_start_loc, layout.seq_lens, num_decodes=num_decodes)
        tables = [s.block_table for s in sequences]
        self.zero_new_blocks(tables)
        # decodes: the new token's slot by arithmetic; the context is read as whole blocks in one gather
        slots = new_slots(tables[:num_decodes], meta.seq_lens, self.block_size)
        meta.context_slots = [None] * num_decodes
        if num_decodes and self.ops is not None:  # the fused kernels: slots, lens and tables in one tensor
            slot_t, meta.decode_lens, meta.decode_block_tables = self._decode_inputs(tables[:num_decodes], slots, meta)
        else:
            slot_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
            if num_decodes:  # SDPA: a padding bias, and for a windowed layer a mask of what precedes its window
                meta.decode_block_tables, meta.decode_bias, meta.decode_lens = self._decode_tables(
                    tables[:num_decodes], meta.seq_lens
                )
                self._window_biases(meta)
        pieces = [slot_t]
        for s in sequences[num_decodes:]:
            ctx = self._slots_of(s.block_table, 0, s.seq_len)
            meta.context_slots.append(ctx if s.start else None)  # a fresh prefill reads no cache
            pieces.append(ctx[s.start :])
        meta.slot_mapping = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [T]
        if self.batch_invariant:
            meta.row_tables, meta.row_lens = self._row_queries(sequences, meta.seq_lens)
        elif self.ops is not None and len(sequences) > num_decodes:  # both kernel sets attend prefills in place
            meta.prefill_block_tables, meta.prefill_seqs = self._prefill_tables(sequences[num_decodes:], meta)
        return meta

    def _prefill_tables(
        self, prefills: Sequence[SequenceInput], meta: PagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused prefill attention's block tables [P, M] (padded with 0) and [P, 3] (first row, new tokens,
        context length) for the prefill sequences, which follow the decodes."""
        width = max(len(s.block_table) for s in prefills)
        padded = [s.block_table + [0] * (width - len(s.block_table)) for s in prefills]
        tables = torch.tensor(padded, dtype=torch.int64, device=self.device)
        starts = meta.query_start_loc[meta.num_decodes :]
        seqs = [[starts[i], starts[i + 1] - starts[i], s.seq_len] for i, s in enumerate(prefills)]
        meta.prefill_max_rows = max(n for _, n, _ in seqs)
        return tables, torch.tensor(seqs, dtype=torch.int64, device=self.device)

    def _row_queries(
        self, sequences: Sequence[SequenceInput], seq_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's query as a decode's: its sequence's block table [T, M] (padded with 0) and its context
        length [T], its own position included."""
        width, padded = padded_tables([s.block_table for s in sequences], seq_lens, self.block_size)
        tables = torch.tensor(padded, dtype=torch.int64).view(len(sequences), width)  # [S, M]
        counts = torch.tensor([s.seq_len - s.start for s in sequences])
        rows = torch.repeat_interleave(torch.arange(len(sequences)), counts)  # [T]: each row's sequence
        lens = torch.cat([torch.arange(s.start + 1, s.seq_len + 1, dtype=torch.int64) for s in sequences])  # [T]
        return tables.index_select(0, rows), lens

    def zero_new_blocks(self, tables: list[list[int]]) -> None:
        """A block is in some table before its first write, so zeroing every id up to the highest seen means the
        batched decode never reads uninitialized memory (a NaN there would survive any mask)."""
        top = max((max(t) for t in tables if t), default=-1) + 1
        if top > self._zeroed_below:
            self._zero_slots(self._zeroed_below * self.block_size, top * self.block_size)
            self._zeroed_below = top

    def _decode_inputs(
        self, tables: list[list[int]], slots: list[int], meta: PagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused kernels' decode inputs as views of one int64 tensor (each torch op costs more than its work
        here): the new tokens' slots [B], the context lengths [B], block tables [B, M] padded with block 0."""
        lens = meta.seq_lens[: len(tables)]
        width, padded = padded_tables(tables, lens, self.block_size)
        values = torch.tensor(slots + lens + padded, dtype=torch.int64, device=self.device)  # [B + B + B * M]
        b = len(tables)
        return values[:b], values[b : 2 * b], values[2 * b :].view(b, width)

    def _decode_tables(
        self, tables: list[list[int]], seq_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block tables [B, M] padded with block 0, the padding bias for SDPA, lens."""
        width, padded = padded_tables(tables, seq_lens, self.block_size)
        block_tables = torch.tensor(padded, dtype=torch.int64, device=self.device).view(len(tables), width)  # [B, M]
        lens = torch.tensor(seq_lens[: len(tables)], dtype=torch.int64, device=self.device)  # [B]
        return block_tables, self._padding_bias(lens, width), lens

    def _padding_bias(self, lens: torch.Tensor, width: int) -> torch.Tensor:  # [B, 1, 1, width * block_size]
        pad = torch.arange(width * self.block_size, device=self.device) >= lens[:, None]  # [B, S]
        bias = torch.zeros(pad.shape, dtype=self.dtype, device=self.device).masked_fill_(pad, float("-inf"))
        return bias[:, None, None, :]

    def _window_biases(self, meta: PagedMetadata) -> None:
        """For each windowed layer's window w: the padding bias, also -inf for the positions before the window."""
        assert meta.decode_bias is not None and meta.decode_lens is not None
        for w in {w for w in self.windows if w is not None}:
            k_pos = torch.arange(meta.decode_bias.shape[-1], device=self.device)
            early = k_pos < meta.decode_lens[:, None] - w  # [B, S]
            meta.window_bias[w] = meta.decode_bias.masked_fill(early[:, None, None, :], float("-inf"))

    def decode_metadata(self, slots: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor) -> PagedMetadata:
        """A decode-only step's metadata from tensors alone (slots, lens [B]; tables [B, M] int64, on the device):
        no host data, so a CUDA graph can record every op that builds it (cuda_graphs.py)."""
        b, width = tables.shape
        bias = None if self.ops is not None else self._padding_bias(lens, width)  # the fused kernels mask by lens
        meta = PagedMetadata(list(range(b + 1)), [0] * b, slot_mapping=slots, num_decodes=b,
                             decode_block_tables=tables, decode_bias=bias, decode_lens=lens)  # fmt: skip
        if bias is not None:
            self._window_biases(meta)
        return meta

    def _slots_of(self, block_table: list[int], start: int, end: int) -> torch.Tensor:  # [end - start]
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    # -- per layer --------------------------------------------------------------------------------------------
    def rope_and_write(
        self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int,
        meta: PagedMetadata, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> bool:  # fmt: skip
        """The GPU kernels' one launch for a layer's (q/k norms,) RoPE and `write` (`CudaKernels.rope_kv_write_`):
        qkv [T, (H + 2 Hkv) * Dh] rotated in place, its k and v rows stored. False where this pool does not take it
        (the CPU's kernels, torch's ops, a quantized pool): the caller rotates and calls `write`."""
        if not isinstance(self.ops, CudaKernels) or qkv.dtype != self.dtype or not qkv.is_contiguous():
            return False
        self.ops.rope_kv_write_(qkv, cos, sin, heads, head_dim, self.cache[layer], meta.slot_mapping, norms)
        return True

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata) -> None:
        if self.ops is not None and k.dtype == self.dtype and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]:
            if self.scales is None:
                self.ops.kv_write(k, v, self.cache[layer], meta.slot_mapping)
            else:
                assert isinstance(self.ops, Kernels)
                self.ops.kv_write(k, v, self.cache[layer], meta.slot_mapping, self.scales[layer])
            return
        for half, x in enumerate((k, v)):
            if self.scales is None:
                self.cache[layer, half].index_copy_(0, meta.slot_mapping, x.to(self.storage))
            else:
                q, scale = quantize_rows(x, self.storage)  # torch has no index_copy_ of float8: as bytes
                self.cache[layer, half].view(torch.uint8).index_copy_(0, meta.slot_mapping, q.view(torch.uint8))
                self.scales[layer, half].index_copy_(0, meta.slot_mapping, scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        nd = meta.num_decodes
        if meta.row_tables is not None and meta.row_lens is not None:  # batch-invariant: every row as a decode
            assert isinstance(self.ops, Kernels)
            return self.ops.decode_attention(q.contiguous(), self.cache[layer], meta.row_tables, meta.row_lens,
                                             self.block_size, window_of(self.windows, layer), sinks,
                                             self._layer_scales(layer))  # fmt: skip
        if nd == meta.num_seqs:  # a decode-only step (the common one): no output buffer to fill piecewise
            return self._decode_batch(layer, q, meta, sinks)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode_batch(layer, q[:nd], meta, sinks)
        tables, seqs, window = meta.prefill_block_tables, meta.prefill_seqs, window_of(self.windows, layer)
        if tables is not None and seqs is not None and q.dtype == self.dtype and q.stride(1) == q.shape[-1]:
            if isinstance(self.ops, Kernels) and q.shape[-1] % 16 == 0:  # every prefill in one call
                self.ops.prefill_attention(
                    q, self.cache[layer], tables, seqs, self.block_size, window, out, sinks, self._layer_scales(layer)
                )  # fmt: skip (prefill_attention.h)
                return out
            if isinstance(self.ops, CudaKernels):  # (kernels/cuda/prefill.py)
                self.ops.prefill_attention(q, self.cache[layer], tables, seqs, self.block_size, window, out, sinks,
                                           max_rows=meta.prefill_max_rows)  # fmt: skip
                return out
        for b in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            slots = meta.context_slots[b]
            if slots is None and self.scales is not None:  # quantized: attend to the rows as stored, as a hit will
                slots = meta.slot_mapping[start:end]
            if slots is None:
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)  # [Hkv, ctx, Dh]
            else:
                keys, values = self._rows(layer, 0, slots).transpose(0, 1), self._rows(layer, 1, slots).transpose(0, 1)
            out[start:end] = attend_sequence(q[start:end], keys, values, window_of(self.windows, layer), sinks)
        return out

    def _decode_batch(
        self, layer: int, q: torch.Tensor, meta: PagedMetadata, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q: [B, H, Dh], one new token per sequence -> [B, H, Dh], all sequences in one call."""
        assert meta.decode_block_tables is not None and meta.decode_lens is not None
        window = window_of(self.windows, layer)
        if isinstance(self.ops, Kernels):
            return self.ops.decode_attention(q.contiguous(), self.cache[layer], meta.decode_block_tables,
                                             meta.decode_lens, self.block_size, window, sinks,
                                             self._layer_scales(layer))  # fmt: skip
        if self.ops is not None:
            return self.ops.decode_attention(q.contiguous(), self.cache[layer], meta.decode_block_tables,
                                             meta.decode_lens, self.block_size, window, sinks)  # fmt: skip
        bias = meta.decode_bias if window is None else meta.window_bias[window]
        assert bias is not None
        b, m = meta.decode_block_tables.shape
        flat = meta.decode_block_tables.reshape(-1)
        keys = self._blocks(layer, 0, flat).view(b, m * self.block_size, *self.cache.shape[-2:])  # [B, S, Hkv, Dh]
        values = self._blocks(layer, 1, flat).view(b, m * self.block_size, *self.cache.shape[-2:])
        h, dh = q.shape[1], q.shape[2]
        hkv = keys.shape[2]
        queries = q.view(b, hkv, h // hkv, dh)  # [B, Hkv, G, Dh]: a KV head's query heads side by side
        if sinks is not None:
            allowed = bias[:, :, :, None, :] == 0  # [B, 1, 1, 1, S]
            o = attend_with_sinks(queries[:, :, :, None], keys.transpose(1, 2), values.transpose(1, 2), sinks, allowed)
            return o.reshape(b, h, dh)
        o = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=bias
        )  # [B, Hkv, G, Dh]
        return o.reshape(b, h, dh)

    def release(self, request_id: str) -> None:
        pass  # the KV manager frees the blocks; their slots are simply overwritten later

    # -- whole blocks, for the prefix cache's tiers (kv_cache/tiers.py) -----------------------------------------
    @property
    def block_nbytes(self) -> int:
        """The bytes of one block's keys and values, every layer's: a tier's payload."""
        num_layers, _, _, num_kv_heads, head_dim = self.cache.shape
        return self.bytes_per_block(num_layers, self.block_size, num_kv_heads, head_dim, self.storage)

    def _block_parts(self, block_id: int) -> list[torch.Tensor]:
        """Views of block `block_id`: its rows [L, 2, bs, Hkv, Dh], and a quantized pool's scales [L, 2, bs, Hkv]."""
        start = block_id * self.block_size
        parts = [self.cache[:, :, start : start + self.block_size]]
        if self.scales is not None:
            parts.append(self.scales[:, :, start : start + self.block_size])
        return parts

    def read_block(self, block_id: int) -> bytes:
        """Block `block_id`'s keys and values as bytes: [L, 2, block_size, Hkv, Dh] in the pool's storage dtype,
        then a quantized pool's scales [L, 2, block_size, Hkv]."""
        return b"".join(bytes(p.contiguous().view(torch.uint8).cpu().numpy().data) for p in self._block_parts(block_id))

    def write_block(self, block_id: int, data: bytes) -> None:
        """Overwrite block `block_id` with what `read_block` gave (of this same layout)."""
        if len(data) != self.block_nbytes:
            raise ValueError(f"a block of this pool is {self.block_nbytes} bytes, got {len(data)}")
        self.zero_new_blocks([[block_id]])  # NOTE: first, or the step's zeroing of new blocks would wipe it
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        at = 0
        for target in self._block_parts(block_id):
            n = target.numel() * target.dtype.itemsize
            target.copy_(source[at : at + n].view(target.dtype).view(target.shape))
            at += n


def new_slots(tables: list[list[int]], seq_lens: list[int], block_size: int) -> list[int]:
    """Each decode's new token's cache slot: position seq_len - 1 of its table."""
    return [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, seq_lens)]


def padded_tables(tables: list[list[int]], seq_lens: list[int], block_size: int) -> tuple[int, list[int]]:
    """Decodes' block tables cut or padded with block 0 to the longest context's blocks: (width M, the [B * M] ids
    row by row)."""
    width = max(-(-n // block_size) for n in seq_lens[: len(tables)])
    return width, [b for t in tables for b in t[:width] + [0] * (width - len(t[:width]))]

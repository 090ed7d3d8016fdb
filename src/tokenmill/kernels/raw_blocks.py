"""A GGUF tensor still in ggml's blocks, as the file holds them: `RawBlocks`, uint8 rows read straight from the
memory map (no copy). The loader turns it into a kernel format in one pass where the compiled kernels are at hand
(csrc/linear/repack.h: the file's bytes to the panels, split across threads), else by decoding its numbers in
torch (formats.py, kformats.py) and packing those: both give the same bytes. Its rows can be reordered and
stacked as they are, because every row of blocks is independent (llama's Q/K un-permutation, fused projections);
a reordering is kept as an index and applied when the rows are read, so a weight the packed cache holds is never
gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.kernels import kformats
from tokenmill.kernels.formats import (
    BLOCK,
    FORMATS,
    PANEL,
    BlockWeight,
    PackedWeight,
    pack_block_weight,
    panel_bytes,
)

# ggml type -> our kernel format, block for block
GGUF_BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", **kformats.GGUF_KTYPES}


@dataclass(frozen=True)
class RawBlocks:
    format: str  # the kernel format the blocks become (GGUF_BLOCK_TYPES)
    raw: torch.Tensor  # uint8 [rows as they lie, K / block k * block bytes]
    k: int
    order: torch.Tensor | None = None  # [N] rows of `raw` in this weight's order, where reordered (`rows`)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0] if self.order is None else self.order.shape[0], self.k)

    def blocks(self) -> torch.Tensor:
        """The rows in order, uint8 [N, K / block k * block bytes]: `raw` itself, or gathered where reordered."""
        return self.raw if self.order is None else self.raw[self.order]

    def rows(self, index: torch.Tensor) -> RawBlocks:
        """These rows, in this order (gathered only when read)."""
        return RawBlocks(self.format, self.raw, self.k, index if self.order is None else self.order[index])

    def row_range(self, start: int, stop: int) -> RawBlocks:
        """Rows start..stop, where they lie (one expert of a GGUF's [E, rows, cols] tensor)."""
        if self.order is not None:
            return RawBlocks(self.format, self.raw, self.k, self.order[start:stop])
        return RawBlocks(self.format, self.raw[start:stop], self.k)

    @staticmethod
    def cat(parts: list[RawBlocks]) -> RawBlocks:
        """The rows of weights of one format stacked (the shards of a fused projection); one part as it is."""
        if len(parts) == 1:
            return parts[0]
        return RawBlocks(parts[0].format, torch.cat([p.blocks() for p in parts]), parts[0].k)

    def numbers(self) -> BlockWeight | kformats.KBlockWeight:
        """The blocks' numbers, decoded in torch (the reference for the kernels' repack)."""
        raw = self.blocks()
        if self.format in kformats.KSPECS:
            return kformats.decode_gguf_rows(self.format, raw, self.k)
        n = raw.shape[0]
        b = raw.reshape(n, -1, 2 + (BLOCK if self.format == "q8_0" else BLOCK // 2))  # {fp16 d, qs}
        d = b[..., :2].contiguous().view(torch.float16).view(n, -1)  # [N, K/32]
        qs = b[..., 2:]  # Q4_0: byte j holds element j in its low nibble, j + 16 in its high one
        q = qs.contiguous().view(torch.int8) if self.format == "q8_0" else torch.cat([qs & 15, qs >> 4], dim=-1)
        return BlockWeight(q.reshape(n, -1), d, self.format)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        if self.format == "mxfp4" and not mxfp4_fits(self):  # (its numbers hold d as fp16): the gguf package's
            import gguf

            values = gguf.quants.dequantize(self.blocks().numpy(), gguf.GGMLQuantizationType.MXFP4)
            return torch.from_numpy(values.copy()).view(self.shape)
        return self.numbers().dequantize()


def mxfp4_fits(w: RawBlocks) -> bool:
    """Whether every MXFP4 block's scale is one the panels hold as fp16 (kformats.mxfp4_scales): e in [104, 143]."""
    e = w.blocks().reshape(-1, 17)[:, 0]  # each block's e8m0 exponent
    return not e.numel() or (int(e.min()) >= 104 and int(e.max()) <= 143)


def pack_raw(w: RawBlocks, ops: Any | None) -> PackedWeight:
    """The blocks in their kernel format: repacked by the compiled kernels `ops` where given, else decoded and
    packed in torch. MXFP4 blocks whose scales no fp16 holds raise kformats.MXFP4ScaleError (the caller loads that
    weight dense)."""
    n, k = w.shape
    if w.format == "mxfp4" and not mxfp4_fits(w):
        raise kformats.MXFP4ScaleError(f"MXFP4 scales outside 2^-24 .. 2^15 in a [{n}, {k}] weight")
    if ops is None:
        return pack_block_weight(w.numbers())
    raw = w.blocks().contiguous()
    out = torch.empty(-(-n // PANEL) * panel_bytes(FORMATS[w.format], k), dtype=torch.uint8)
    ops.module.repack_gguf(raw.data_ptr(), FORMATS[w.format], n, k, raw.shape[1], out.data_ptr())
    return PackedWeight(out, w.format, n, k, k)


def dequantize_raw(w: RawBlocks, ops: Any | None, packed: PackedWeight | None = None) -> torch.Tensor:
    """The blocks as float32 [N, K] (an embedding's table, a weight that stays dense): unpacked by the compiled
    kernels from their panels (`packed`, or packed here), else decoded in torch; the same numbers either way."""
    if ops is None:
        return w.dequantize()
    p = packed or pack_raw(w, ops)
    return ops.unpack(p.data, FORMATS[p.format], p.out_features, p.padded_in)[:, : p.in_features]

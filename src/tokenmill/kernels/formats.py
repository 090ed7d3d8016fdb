"""Weight formats for the kernels, packed with torch ops at load time, and their pure-torch reference.

Every format groups output channels in panels of P=16:
- `bf16`: [K/2][16][2] bfloat16 per panel (k-major in pairs, K padded to even); `f32`: [K][16] float32 per
  panel (k-major, gemm.h says why);
- `q8_0` (ggml's Q8_0: blocks of 32 int8 with one fp16 scale, w = d * q): per panel, K/32 blocks of
  {fp16 d[16]; int8 q[8][16][4]}, q[g][c][i] the weight of channel c at k = 4g + i;
- `q4_0` (ggml's Q4_0: blocks of 32 4-bit values with one fp16 scale, w = d * (q - 8)): per panel, K/32
  blocks of {fp16 d[16]; uint8 q[8][8][4]}, byte [g][c][i] holding channel c at k = 4g + i in its low nibble
  and channel c + 8 in its high one.
The quantized layouts group 4 k per channel for the kernels' 8-bit integer dot products (qdot.h), which
multiply by activations quantized per row to Q8_0 blocks (`quantize_activations`); `reference_linear` is the
same product in torch. The quantizers reproduce ggml's reference rounding, so a GGUF's Q8_0/Q4_0 blocks and
ours hold the same bytes (only their order differs). Rows are padded with zeros to whole panels, and K to
whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import kformats
from tokenmill.kernels.kquantize import quantize_k
from tokenmill.kernels.panels import BLOCK, FORMATS, PANEL

__all__ = ["BLOCK", "FORMATS", "PANEL"]
QUANTIZED = ("q8_0", "q4_0", *kformats.KSPECS)  # the formats whose kernels multiply quantized activation rows
ROW_GROUP = {"q4_k": 256, "q5_k": 256, "q6_k": 256}  # k per activation scale where not 32 (linear/format.h)


def format_name(format_id: int) -> str:
    return next(f for f, i in FORMATS.items() if i == format_id)


CHUNK_ROWS = 4096  # rows quantized at a time: bounds the float32 temporaries of a 150k-row LM head
# and at most ~this many bytes of float32 rows a chunk: the temporaries of quantizing one (a K-quant's ~8x its
# float32 rows) stay ~130 MB whatever the weight, where 4096 rows of a wide weight took over a GB. Smaller chunks
# quantize K-quants slower (4 MB: 1.7-1.9x the time of 16 MB on a 1536 x 8960 weight; Xeon, 2026-11-29)
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor  # uint8, the panels back to back
    format: str
    out_features: int  # N
    in_features: int  # K as the model has it
    padded_in: int  # K as packed (a whole number of blocks for the quantized formats)

    @property
    def format_id(self) -> int:
        return FORMATS[self.format]


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (ggml rounds this way; torch.round rounds half to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] (K a multiple of 32) -> (int8 q [N, K], fp16 d [N, K/32]): d = max|w| / 127, q = roundf(w / d)."""
    n, k = w.shape
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0  # [N, K/32] float32, as ggml divides by it before rounding to fp16
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = _round_half_away(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k), d.to(torch.float16)


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (uint8 q in 0..15 [N, K], fp16 d [N, K/32]): d = (the value of largest magnitude) / -8,
    q = min(15, trunc(w / d + 8.5)), as ggml's quantize_row_q4_0_ref."""
    n, k = w.shape
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    index = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as ggml's strict '<'
    d = blocks.gather(-1, index)[..., 0] / -8.0  # [N, K/32]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.trunc(blocks * inv[..., None] + 8.5).clamp(0, 15).to(torch.uint8)
    return q.view(n, k), d.to(torch.float16)


def _panels(t: torch.Tensor, n_padded: int) -> torch.Tensor:
    """[N, ...] -> [N / 16, 16, ...], zero rows appended up to `n_padded`."""
    if t.shape[0] < n_padded:
        t = torch.cat([t, t.new_zeros(n_padded - t.shape[0], *t.shape[1:])])
    return t.view(n_padded // PANEL, PANEL, *t.shape[1:])


# llama-quantize's stand-ins for a K-quant whose rows are not whole superblocks of 256 (llama.cpp's
# tensor-type fallback): so does `pack`
K_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def format_for(fmt: str, k: int) -> str:
    """The format a [*, k] weight asked to be `fmt` is packed in: a K-quant's fallback where k is not a multiple
    of 256, as llama-quantize gives such tensors."""
    return K_FALLBACK[fmt] if fmt in K_FALLBACK and k % 256 else fmt


def pack(w: torch.Tensor, fmt: str) -> PackedWeight:
    """Pack a [N, K] weight (any float dtype) into `fmt` (`format_for`'s: a K-quant may fall back)."""
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r} is not supported; allowed: {', '.join(FORMATS)}")
    n, k = w.shape
    fmt = format_for(fmt, k)
    kp = {"f32": k, "bf16": k + k % 2}.get(fmt, -(-k // BLOCK) * BLOCK)
    n_padded = -(-n // PANEL) * PANEL
    step = max(PANEL, min(CHUNK_ROWS, CHUNK_BYTES // (4 * kp) // PANEL * PANEL))  # whole panels a chunk
    out: torch.Tensor | None = None  # [panels x panel bytes] uint8, written chunk by chunk (no second copy)
    for start in range(0, n, step):
        rows = w[start : start + step].detach()
        if kp != k:
            rows = torch.nn.functional.pad(rows.float(), (0, kp - k))
        panels = min(step, n_padded - start) // PANEL
        chunk = _pack_rows(rows, fmt, panels * PANEL)
        if out is None:
            out = torch.empty(n_padded // PANEL * (chunk.numel() // panels), dtype=torch.uint8)
        at = start // PANEL * (chunk.numel() // panels)
        out[at : at + chunk.numel()] = chunk
    assert out is not None, "a weight has at least one row"
    return PackedWeight(out, fmt, n, k, kp)


def _pack_rows(rows: torch.Tensor, fmt: str, n_padded: int) -> torch.Tensor:
    if fmt in ("bf16", "f32"):
        panels = _panels(rows.to(torch.bfloat16 if fmt == "bf16" else torch.float32), n_padded)  # [np, 16, K]
        if fmt == "bf16":  # [np, 16, K/2, 2] -> [np, K/2, 16, 2]
            return panels.unflatten(2, (-1, 2)).transpose(1, 2).contiguous().view(torch.uint8).reshape(-1)
        return panels.transpose(1, 2).contiguous().view(torch.uint8).reshape(-1)
    if fmt in kformats.KSPECS:
        return kformats.pack_kblocks(quantize_k(rows, fmt), n_padded)
    q, d = quantize_q8_0(rows) if fmt == "q8_0" else quantize_q4_0(rows)
    return pack_blocks(q, d, fmt, n_padded)


def pack_blocks(q: torch.Tensor, d: torch.Tensor, fmt: str, n_padded: int) -> torch.Tensor:
    """Quantized values q [N, K] (int8, or uint8 0..15 for q4_0) and fp16 scales d [N, K/32], as ggml's blocks
    hold them, -> the panels of `fmt` (bytes). Only the order changes: a GGUF's blocks load through here."""
    nb = q.shape[1] // BLOCK
    q = _panels(q, n_padded).view(-1, PANEL, nb, BLOCK // 4, 4)  # [np, c 16, nb, g 8, i 4]
    if fmt == "q4_0":
        q = q[:, : PANEL // 2] | (q[:, PANEL // 2 :] << 4)  # [np, 8, nb, 8, 4]: channel c low, c + 8 high
    scales = _panels(d, n_padded).permute(0, 2, 1).contiguous().view(torch.uint8)  # [np, nb, 32] bytes
    values = q.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8)  # [np, nb, g, c, i] -> bytes
    return torch.cat([scales, values.reshape(*scales.shape[:2], -1)], dim=-1).reshape(-1)


def unpack_blocks(p: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A q8_0 / q4_0 weight's block values, in ggml's row order: (int8 q [N, K'] (q4_0's as -8..7), fp16 d
    [N, K'/32]), K' the padded width. `pack_blocks` in reverse."""
    if p.format not in ("q8_0", "q4_0"):
        raise ValueError(f"unpack_blocks takes q8_0 or q4_0 weights, not {p.format}")
    n_panels, nb = -(-p.out_features // PANEL), p.padded_in // BLOCK
    per_k = BLOCK if p.format == "q8_0" else BLOCK // 2
    blocks = p.data.view(n_panels, nb, 2 * PANEL + per_k * PANEL)
    d = blocks[..., : 2 * PANEL].contiguous().view(torch.float16)  # [np, nb, c 16]
    raw = blocks[..., 2 * PANEL :].reshape(n_panels, nb, BLOCK // 4, -1, 4)  # [np, nb, g, c, i]
    if p.format == "q8_0":
        q = raw.view(torch.int8)  # [np, nb, g 8, c 16, i 4]
    else:  # channels 0..7 in the low nibbles, 8..15 in the high ones
        q = (torch.cat([raw & 15, raw >> 4], dim=3).to(torch.int16) - 8).to(torch.int8)
    q = q.permute(0, 3, 1, 2, 4).reshape(n_panels * PANEL, p.padded_in)  # [np, c, nb, g, i] -> [N', K']
    d = d.permute(0, 2, 1).reshape(n_panels * PANEL, nb)
    return q[: p.out_features].contiguous(), d[: p.out_features].contiguous()


def unpack(p: PackedWeight) -> torch.Tensor:
    """The packed weight as float32 [N, K] (the reference for the kernels, and the dequantized weight)."""
    n_panels, kp = -(-p.out_features // PANEL), p.padded_in
    if p.format in kformats.KSPECS:
        return kformats.unpack_kpanels(p.data, p.format, p.out_features, kp)[:, : p.in_features]
    if p.format in ("bf16", "f32"):
        if p.format == "bf16":  # [np, K/2, 16, 2] -> [np, 16, K]
            pairs = p.data.view(torch.bfloat16).view(n_panels, kp // 2, PANEL, 2)
            w = pairs.transpose(1, 2).reshape(n_panels * PANEL, kp).float()
        else:
            w = p.data.view(torch.float32).view(n_panels, kp, PANEL).transpose(1, 2).reshape(n_panels * PANEL, kp)
    else:
        nb, per_k = kp // BLOCK, BLOCK if p.format == "q8_0" else BLOCK // 2
        blocks = p.data.view(n_panels, nb, 2 * PANEL + per_k * PANEL)
        d = blocks[..., : 2 * PANEL].contiguous().view(torch.float16).float()  # [np, nb, 16]
        raw = blocks[..., 2 * PANEL :].reshape(n_panels, nb, BLOCK // 4, -1, 4)  # [np, nb, g, c, i]
        # q8_0: int8 [np, nb, 8, 16, 4]; q4_0: channels 0..7 in the low nibbles, 8..15 in the high ones
        q = raw.view(torch.int8).float() if p.format == "q8_0" else torch.cat([raw & 15, raw >> 4], dim=3).float() - 8
        q = q.permute(0, 1, 3, 2, 4).reshape(n_panels, nb, PANEL, BLOCK)  # [np, nb, c, k]
        w = (q * d[..., None]).permute(0, 2, 1, 3).reshape(n_panels * PANEL, kp)
    return w[: p.out_features, : p.in_features]


def quantize_activations(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of `group`) -> (int8 q [M, K], float32 d [M, K/32]), as the kernels quantize each row
    before an integer dot product (linear/qrow.h): ggml's Q8_0 (d = max|x| / 127 per block of 32, q = x / d rounded
    to nearest, ties to even, as ggml's AVX2 quantize_row_q8_0) with d kept in float32; with `group` 256, as for
    the K-quants (ggml's Q8_K), one d per 256 values, repeated in each of its blocks."""
    m, k = x.shape
    groups = x.float().view(m, k // group, group)
    d = groups.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(groups * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(m, k), d.repeat_interleave(group // BLOCK, dim=1)


def row_group(fmt: str) -> int:
    """k per activation scale in the rows the format's kernels read (linear/format.h: row_group)."""
    return ROW_GROUP.get(fmt, BLOCK)


def reference_linear(
    x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None = None, group: int = 0
) -> torch.Tensor:
    """x [M, K] @ the packed weight^T (+ bias) in float32, as the kernels compute it: the quantized formats
    multiply by the activations quantized per row (up to float rounding, the kernels' exact integer sums), one scale
    per `group` k where that is more than the format's own (a fused projection's segments: models/linear.py)."""
    x = x.float()
    if p.format in QUANTIZED:
        xp = torch.nn.functional.pad(x, (0, p.padded_in - p.in_features))
        q, d = quantize_activations(xp, max(group, row_group(p.format)))
        x = (q.float().view(*d.shape, BLOCK) * d[..., None]).view(xp.shape)[:, : p.in_features]
    return torch.nn.functional.linear(x, unpack(p), bias)


@dataclass(frozen=True)
class BlockWeight:
    """A weight still in ggml's blocks, as a GGUF holds it: q [N, K] (int8 for q8_0, uint8 0..15 for q4_0) and
    fp16 scales d [N, K/32]. It becomes a kernel format with `pack_block_weight`, with no re-quantization."""

    q: torch.Tensor
    d: torch.Tensor
    format: str  # "q8_0" | "q4_0"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, ggml's dequantize_row_q8_0 / _q4_0
        q = self.q.float() - (8.0 if self.format == "q4_0" else 0.0)
        return (q.view(self.q.shape[0], -1, BLOCK) * self.d.float()[..., None]).view(self.shape)


def pack_block_weight(w: BlockWeight | kformats.KBlockWeight) -> PackedWeight:
    """A weight in ggml's blocks -> its kernel format, the same numbers (only their order changes)."""
    n, k = w.shape
    n_padded = -(-n // PANEL) * PANEL
    if isinstance(w, kformats.KBlockWeight):
        chunks = [kformats.pack_kblocks(part, min(CHUNK_ROWS, n_padded - start))
                  for start, part in _row_chunks(w, n)]  # fmt: skip
        return PackedWeight(torch.cat(chunks), w.format, n, k, k)
    return PackedWeight(pack_blocks(w.q, w.d, w.format, n_padded), w.format, n, k, k)


def _row_chunks(w: kformats.KBlockWeight, n: int) -> list[tuple[int, kformats.KBlockWeight]]:
    """CHUNK_ROWS rows at a time (whole panels): bounds the packer's temporaries on a 150k-row LM head."""
    return [(start, w.rows(slice(start, start + CHUNK_ROWS))) for start in range(0, n, CHUNK_ROWS)]


def panel_bytes(format_id: int, k: int) -> int:
    """The bytes of one packed panel (PANEL output channels) of a format `format_id` weight k wide."""
    if format_id in (FORMATS["bf16"], FORMATS["f32"]):
        return k * PANEL * (2 if format_id == FORMATS["bf16"] else 4)
    name = format_name(format_id)
    if name in kformats.KSPECS:
        spec = kformats.KSPECS[name]
        return k // spec.sb * spec.sb_bytes
    per_k = BLOCK if format_id == FORMATS["q8_0"] else BLOCK // 2
    return (k // BLOCK) * (2 * PANEL + per_k * PANEL)


def check_packed(packed: torch.Tensor, format_id: int, n: int, k: int) -> None:
    """A ValueError unless `packed` is a contiguous uint8 CPU tensor holding a format `format_id` [n, k] weight."""
    if packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.device.type != "cpu":
        raise ValueError("packed weights must be a contiguous uint8 CPU tensor")
    if packed.numel() != -(-n // PANEL) * panel_bytes(format_id, k):
        raise ValueError(f"packed weights hold {packed.numel()} bytes, not a format {format_id} [{n}, {k}] weight")

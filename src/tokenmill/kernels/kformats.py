"""The K family of weight formats: ggml's K-quants (Q4_K, Q5_K, Q6_K), the legacy Q5_0, Q5_1 and Q4_1 that
llama-quantize falls back to, the non-linear IQ4_NL and IQ4_XS, and MXFP4 (gpt-oss's experts), as GGUF files (and
for MXFP4 also Hugging Face checkpoints) hold them and as the kernels multiply them (csrc/linear/kformat.h draws the
panel layout; this module packs it with torch ops).

Each is an unsigned q of 4, 5 or 6 bits per weight, its value v(q), and per sub-block w = scale * (v(q) - zero) - min:
- Q4_K, Q5_K: superblocks of 256 (fp16 d, dmin), 8 sub-blocks of 32 with 6-bit sc, mn: scale = d sc, min = dmin mn;
- Q6_K: superblocks of 256 (fp16 d), 16 sub-blocks of 16 with int8 sc: scale = d sc, zero = 32;
- Q5_0: blocks of 32, fp16 d, zero = 16; Q5_1 / Q4_1: blocks of 32, fp16 d and m: min = -m;
- IQ4_NL: blocks of 32, fp16 d; IQ4_XS: superblocks of 256 (fp16 d), 8 sub-blocks of 32 with sc = (6-bit scale) - 32:
  scale = d sc. Their 4-bit q index ggml's table of 16 levels (`IQ4_LEVELS`): v(q) = level + 128, zero = 128.
- MXFP4: blocks of 32 under one e8m0 exponent e; q an FP4 e2m1 code, its value doubled in `MXFP4_LEVELS` (as ggml's),
  so scale = d = 2^(e - 128), held as an exact fp16 (e in [104, 143]; a tensor with another e is refused:
  `MXFP4ScaleError`, and it loads dequantized). v(q) = level + 128, zero = 128.
v(q) is q itself but for the table formats.
`decode_gguf_rows` takes a GGUF tensor's block bytes apart into those numbers (`KBlockWeight`), and
`pack_kblocks` lays them out as the kernels read them: the numbers are ggml's own, so nothing is re-quantized and
the product is the one llama.cpp computes (up to the activations' quantization: Q8_0 blocks here, Q8_K there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.kernels.panels import BLOCK, PANEL

# ggml's kvalues_iq4nl: the 16 levels of IQ4_NL and IQ4_XS, w = scale * level
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# FP4 e2m1's 16 values (bit 3 the sign), doubled (ggml's kvalues_mxfp4): w = 2^(e - 128) * level
MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


class MXFP4ScaleError(ValueError):
    """An MXFP4 block's power-of-two scale that no fp16 holds (the panels keep d as fp16)."""


@dataclass(frozen=True)
class KSpec:
    sb: int  # k per superblock
    sub: int  # k per sub-block
    planes: int  # bits above the low 4
    has_min: bool
    zero: int
    gguf_bytes: int  # bytes of one ggml block (a superblock)
    table: tuple[int, ...] = ()  # q indexes these levels (v(q) = level + 128), else v(q) = q

    @property
    def subs(self) -> int:
        return self.sb // self.sub

    @property
    def has_sc(self) -> bool:
        return self.subs > 1

    @property
    def header_bytes(self) -> int:  # per panel and superblock: d, dmin, sc, mn (csrc/linear/format.h)
        return 2 * PANEL * (1 + self.has_min) + (self.subs * PANEL * (1 + self.has_min) if self.has_sc else 0)

    @property
    def block_bytes(self) -> int:  # per panel and block of 32: the nibbles, then the bits above them
        return BLOCK // 2 * PANEL + self.planes * 64

    @property
    def sb_bytes(self) -> int:
        return self.header_bytes + self.sb // BLOCK * self.block_bytes


# the kernels' format name -> its spec (the same table as csrc/linear/format.h's kSpecs)
KSPECS = {
    "q4_k": KSpec(256, 32, 0, True, 0, 144),
    "q5_k": KSpec(256, 32, 1, True, 0, 176),
    "q6_k": KSpec(256, 16, 2, False, 32, 210),
    "q5_0": KSpec(32, 32, 1, False, 16, 22),
    "q5_1": KSpec(32, 32, 1, True, 0, 24),
    "q4_1": KSpec(32, 32, 0, True, 0, 20),
    "iq4_nl": KSpec(32, 32, 0, False, 128, 18, table=IQ4_LEVELS),
    "iq4_xs": KSpec(256, 32, 0, False, 128, 136, table=IQ4_LEVELS),
    "mxfp4": KSpec(32, 32, 0, False, 128, 17, table=MXFP4_LEVELS),
}
GGUF_KTYPES = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_1": "q4_1",
               "IQ4_NL": "iq4_nl", "IQ4_XS": "iq4_xs", "MXFP4": "mxfp4"}  # fmt: skip
# the formats --quantization makes (kquantize.py): the gguf package has no reference quantizer for IQ4 to match
QUANTIZABLE = tuple(f for f, spec in KSPECS.items() if not spec.table)


def values(fmt: str, q: torch.Tensor) -> torch.Tensor:
    """v(q) as float32: q itself, or for IQ4 its level + 128 (the unsigned bytes the kernels multiply)."""
    table = KSPECS[fmt].table
    if not table:
        return q.float()
    return (torch.tensor(table, dtype=torch.float32) + 128)[q.long()]


@dataclass(frozen=True)
class KBlockWeight:
    """A weight in one of the K family's blocks, as numbers: q uint8 [N, K] (0 .. 2^bits - 1; IQ4's table indices),
    d fp16 [N, K/sb], dmin fp16 [N, K/sb] (formats with a min), sc int8 and mn uint8 [N, K/sub] (formats with
    sub-blocks)."""

    format: str
    q: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def rows(self, index: torch.Tensor | slice) -> KBlockWeight:
        """These rows (whole blocks each): the packer takes a large weight a chunk at a time."""
        return replace(self, **{f: getattr(self, f)[index] for f in _FIELDS if getattr(self, f) is not None})

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, as ggml's dequantize_row_*
        spec = KSPECS[self.format]
        n, k = self.shape
        scale = self.d.float().repeat_interleave(spec.subs, dim=1)  # [N, K/sub]
        if spec.has_sc:
            scale = scale * self.sc.float()  # type: ignore[union-attr]
        w = scale[..., None] * (values(self.format, self.q).view(n, -1, spec.sub) - spec.zero)
        if spec.has_min:
            mins = self.dmin.float().repeat_interleave(spec.subs, dim=1)  # type: ignore[union-attr]
            w = w - (mins * self.mn.float() if spec.has_sc else mins)[..., None]  # type: ignore[union-attr]
        return w.view(n, k)


_FIELDS = ("q", "d", "dmin", "sc", "mn")


def _u16(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] bytes -> [...] fp16
    return raw.contiguous().view(torch.float16)[..., 0]


def _scales_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [R, 12] -> 6-bit sc, mn [R, 8] (ggml's get_scale_min_k4)."""
    s = s.to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc.to(torch.int8), mn.to(torch.uint8)


def _scales_iq4_xs(s: torch.Tensor) -> torch.Tensor:
    """IQ4_XS's scales_h (u16) and scales_l[4] [R, 6] -> int8 sc [R, 8]: sub-block j's 6-bit scale (scales_l's
    nibble j, low first, under bits 2j, 2j + 1 of scales_h) less 32."""
    s = s.to(torch.int32)
    high = s[:, 0] | (s[:, 1] << 8)  # [R]
    low = torch.stack([s[:, 2:6] & 15, s[:, 2:6] >> 4], dim=2).reshape(-1, 8)  # [R, 8]
    top = (high[:, None] >> (2 * torch.arange(8, dtype=torch.int32))) & 3
    return (low | (top << 4)).sub(32).to(torch.int8)


def _nibbles_k(qs: torch.Tensor) -> torch.Tensor:
    """K-quant qs [R, 128] -> low 4 bits [R, 256]: each 32 bytes give a sub-block's low nibbles, then the next's."""
    qs = qs.view(-1, 4, 1, 32)
    return torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, 256)


def decode_gguf_rows(fmt: str, raw: torch.Tensor, k: int) -> KBlockWeight:
    """A GGUF tensor's rows of ggml blocks, uint8 [N, K / sb * block bytes] -> their numbers."""
    spec = KSPECS[fmt]
    n = raw.shape[0]
    blocks = raw.reshape(n * (k // spec.sb), spec.gguf_bytes)  # [R, bytes], R = N * superblocks
    sc = mn = dmin = None
    if fmt in ("q4_k", "q5_k"):  # {d, dmin, scales[12], (qh[32]), qs[128]}
        d, dmin = _u16(blocks[:, 0:2]), _u16(blocks[:, 2:4])
        sc, mn = _scales_k4(blocks[:, 4:16])
        q = _nibbles_k(blocks[:, -128:])
        if fmt == "q5_k":  # bit j of qh[l] is bit 4 of sub-block j's weight l
            qh = blocks[:, 16:48].to(torch.int32)
            bit = (qh[:, None, :] >> torch.arange(8, dtype=torch.int32)[None, :, None]) & 1  # [R, 8 subs, 32]
            q = q | (bit.reshape(-1, 256) << 4).to(torch.uint8)
    elif fmt == "iq4_xs":  # {d, scales_h u16, scales_l[4], qs[128]}: each 16 bytes of qs a sub-block, as Q4_0's
        d = _u16(blocks[:, 0:2])
        sc = _scales_iq4_xs(blocks[:, 2:8])
        qs = blocks[:, 8:].reshape(-1, 8, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, 256)
    elif fmt == "mxfp4":  # {e, qs[16]}: qs as IQ4_NL's
        d = mxfp4_scales(blocks[:, 0])
        q = torch.cat([blocks[:, 1:] & 15, blocks[:, 1:] >> 4], dim=1)  # [R, 32]
    elif fmt == "q6_k":  # {ql[128], qh[64], scales[16] int8, d}
        ql, qh = blocks[:, :128].reshape(-1, 2, 2, 32), blocks[:, 128:192].reshape(-1, 2, 1, 32)
        low = torch.cat([ql & 15, ql >> 4], dim=2)  # [R, half, 4 quarters, 32]: ql[l], ql[l+32], then their highs
        high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)) & 3
        q = (low | (high << 4)).reshape(-1, 256)
        sc, d = blocks[:, 192:208].contiguous().view(torch.int8), _u16(blocks[:, 208:210])
    else:  # q5_0 {d, qh u32, qs[16]}, q5_1 {d, m, qh, qs[16]}, q4_1 {d, m, qs[16]}, iq4_nl {d, qs[16]}
        d = _u16(blocks[:, 0:2])
        if spec.has_min:
            dmin = -_u16(blocks[:, 2:4])  # w = d q + m = d q - (-m)
        qs = blocks[:, -16:]
        q = torch.cat([qs & 15, qs >> 4], dim=1)  # [R, 32]
        if spec.planes:
            at = 2 + 2 * spec.has_min
            qh = blocks[:, at : at + 4].to(torch.int64)
            word = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24  # bit j: weight j's bit 4
            q = q | (((word[:, None] >> torch.arange(32)) & 1) << 4).to(torch.uint8)
    return KBlockWeight(fmt, q.reshape(n, k).contiguous(), d.reshape(n, -1), _rows(dmin, n), _rows(sc, n), _rows(mn, n))


def mxfp4_scales(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's e8m0 exponents (uint8, any shape) -> d = 2^(e - 128) as fp16, exactly, or MXFP4ScaleError."""
    x = e.to(torch.int32) - 128
    if x.numel() and (x.min() < -24 or x.max() > 15):
        raise MXFP4ScaleError(f"MXFP4 scales 2^{x.min().item()} .. 2^{x.max().item()}: the panels hold 2^-24 .. 2^15")
    return torch.exp2(x.float()).to(torch.float16)


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> KBlockWeight:
    """A Hugging Face MXFP4 weight (gpt-oss: `*_blocks` uint8 [N, K / 32, 16], value 2j of a block in byte j's low
    nibble and 2j + 1 in its high one; `*_scales` uint8 [N, K / 32], e8m0) -> its numbers. transformers' e2m1 table
    is MXFP4_LEVELS / 2 in the same order, and its scale 2^(e - 127), so q and e carry over as they are."""
    n, groups = scales.shape
    q = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(n, groups * 32)  # [N, K]
    return KBlockWeight("mxfp4", q.contiguous(), mxfp4_scales(scales).reshape(n, groups))


def encode_gguf_rows(w: KBlockWeight) -> torch.Tensor:
    """`decode_gguf_rows` in reverse: the numbers -> ggml's block bytes, uint8 [N, K / sb * block bytes]."""
    spec = KSPECS[w.format]
    n = w.shape[0]
    q = w.q.reshape(-1, spec.sb)  # [R, sb]
    halves = [w.d.reshape(-1, 1).contiguous().view(torch.uint8)]
    if w.format == "mxfp4":  # {e, qs[16]}: d = 2^(e - 128)
        e = (torch.log2(w.d.float()).round().to(torch.int32) + 128).reshape(-1, 1)
        halves = [torch.where(w.d.reshape(-1, 1) == 0, 0, e).to(torch.uint8)]
    if w.format in ("q4_k", "q5_k"):
        sc, mn = w.sc.reshape(-1, 8).to(torch.uint8), w.mn.reshape(-1, 8)  # type: ignore[union-attr]
        scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], dim=1)  # fmt: skip
        subs = q.view(-1, 4, 2, 32)  # [R, pair, low/high, 32]
        qs = ((subs[:, :, 0] & 15) | ((subs[:, :, 1] & 15) << 4)).reshape(-1, 128)
        parts = [*halves, w.dmin.reshape(-1, 1).contiguous().view(torch.uint8), scales]  # type: ignore[union-attr]
        if w.format == "q5_k":
            bits = ((q.view(-1, 8, 32) >> 4) & 1).to(torch.int32) << torch.arange(8, dtype=torch.int32)[None, :, None]
            parts.append(bits.sum(1).to(torch.uint8))  # qh[l]: bit j from sub-block j
        parts.append(qs)
    elif w.format == "iq4_xs":
        ls = w.sc.reshape(-1, 8).to(torch.int32) + 32  # type: ignore[union-attr]
        high = ((ls >> 4) << (2 * torch.arange(8, dtype=torch.int32))).sum(1)  # [R] scales_h
        low = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).to(torch.uint8)  # [R, 4] scales_l
        subs = q.view(-1, 8, 2, 16)  # [R, sub-block, low/high nibble, 16]
        qs = (subs[:, :, 0] | (subs[:, :, 1] << 4)).reshape(-1, 128)
        parts = [*halves, torch.stack([high & 255, high >> 8], dim=1), low, qs]
    elif w.format == "q6_k":
        quarters = q.view(-1, 2, 4, 32)  # [R, half, t, l]: k = 128 half + 32 t + l
        low = quarters & 15
        ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)  # [R, 2, 64]
        shifts = (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 4, 1)
        qh = ((quarters >> 4).to(torch.int32) << shifts).sum(2).to(torch.uint8)  # [R, 2, 32]
        sc = w.sc.reshape(-1, 16).contiguous().view(torch.uint8)  # type: ignore[union-attr]
        parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc, *halves]
    else:
        parts = list(halves)
        if spec.has_min:
            parts.append((-w.dmin).reshape(-1, 1).contiguous().view(torch.uint8))  # type: ignore[operator]
        if spec.planes:
            bits = ((q >> 4) & 1).to(torch.int64) << torch.arange(32)
            word = bits.sum(1)
            parts.append(torch.stack([(word >> (8 * i)) & 255 for i in range(4)], dim=1).to(torch.uint8))
        parts.append((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4))
    return torch.cat([p.to(torch.uint8) for p in parts], dim=1).reshape(n, -1)


def _rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(n, -1).contiguous()


def _panels(t: torch.Tensor, n_padded: int) -> torch.Tensor:
    """[N, ...] -> [N / 16, 16, ...], zero rows appended up to `n_padded`."""
    if t.shape[0] < n_padded:
        t = torch.cat([t, t.new_zeros(n_padded - t.shape[0], *t.shape[1:])])
    return t.view(n_padded // PANEL, PANEL, *t.shape[1:])


def _bytes(t: torch.Tensor) -> torch.Tensor:  # [np, 16, nsb, ...] -> [np, nsb, bytes] (channel inner)
    t = t.movedim(1, -1).contiguous()  # [np, nsb, ..., 16]
    return t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)


def pack_kblocks(w: KBlockWeight, n_padded: int) -> torch.Tensor:
    """The numbers -> the kernels' panels (bytes), csrc/linear/kformat.h's layout: per panel and superblock the
    header, then each block of 32 as its nibbles (Q4_0's order) and the bits above them, group by group."""
    spec = KSPECS[w.format]
    k = w.shape[1]
    nsb, per_sb = k // spec.sb, spec.sb // BLOCK
    parts = [_bytes(_panels(w.d, n_padded))]  # [np, nsb, 32]
    per_sub = [w.sc, w.mn] if spec.has_sc else []  # [N, nsb * subs] -> [np, 16, nsb, subs]
    for t in [w.dmin, *per_sub]:
        if t is not None:  # the format's fields, in the header's order: dmin, sc, mn
            t = _panels(t, n_padded)
            parts.append(_bytes(t if t.shape[2] == nsb else t.unflatten(2, (nsb, spec.subs))))
    q = _panels(w.q, n_padded).view(-1, PANEL, nsb, per_sb, BLOCK // 4, 4)  # [np, c, nsb, j, g, i]
    low = q & 15
    nib = low[:, : PANEL // 2] | (low[:, PANEL // 2 :] << 4)  # [np, 8, nsb, j, g, i]
    blocks = [nib.permute(0, 2, 3, 4, 1, 5).reshape(q.shape[0], nsb, per_sb, -1)]  # [np, nsb, j, 256]
    if spec.planes == 1:  # bit w = 4c + i of the group's 64-bit word: byte w // 8, bit w % 8
        bit = (q >> 4).permute(0, 2, 3, 4, 1, 5).reshape(*q.shape[:1], nsb, per_sb, 8, 8, 8).to(torch.int32)
        byte = (bit << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)  # [np, nsb, j, g, 8 bytes]
        blocks.append(byte.reshape(q.shape[0], nsb, per_sb, 64))
    elif spec.planes == 2:  # Q6_K: h = q >> 4 of weight w = 4c + i in byte w % 16, bits 2 (w // 16) and up
        h = (q >> 4).permute(0, 2, 3, 4, 1, 5).reshape(q.shape[0], nsb, per_sb, 8, 4, 16).to(torch.int32)
        byte = (h << (2 * torch.arange(4, dtype=torch.int32)).view(4, 1)).sum(-2).to(torch.uint8)  # [.., g, 16]
        blocks.append(byte.reshape(q.shape[0], nsb, per_sb, 128))
    body = torch.cat(blocks, dim=-1).reshape(q.shape[0], nsb, -1)  # [np, nsb, per_sb * block bytes]
    return torch.cat([*parts, body], dim=-1).reshape(-1)


def unpack_kpanels(data: torch.Tensor, fmt: str, n: int, k: int) -> torch.Tensor:
    """`pack_kblocks` in reverse, to float32 [N, K] (the kernels' reference)."""
    spec = KSPECS[fmt]
    n_panels, nsb, per_sb = -(-n // PANEL), k // spec.sb, spec.sb // BLOCK
    sbs = data.view(n_panels, nsb, spec.sb_bytes)
    at = 0

    def take(width: int, dtype: torch.dtype) -> torch.Tensor:  # [np, nsb, width bytes] -> [np, 16, nsb, ...]
        nonlocal at
        part = sbs[..., at : at + width].contiguous().view(dtype)
        at += width
        return part.view(n_panels, nsb, -1, PANEL).permute(0, 3, 1, 2).reshape(n_panels * PANEL, -1)

    d = take(2 * PANEL, torch.float16)
    dmin = take(2 * PANEL, torch.float16) if spec.has_min else None
    sc = take(spec.subs * PANEL, torch.int8) if spec.has_sc else None
    mn = take(spec.subs * PANEL, torch.uint8) if spec.has_sc and spec.has_min else None
    body = sbs[..., at:].reshape(n_panels, nsb, per_sb, spec.block_bytes)
    nib = body[..., :256].reshape(n_panels, nsb, per_sb, 8, 8, 4)  # [np, nsb, j, g, c 8, i]
    q = torch.cat([nib & 15, nib >> 4], dim=4)  # [np, nsb, j, g, c 16, i]
    if spec.planes:
        high = body[..., 256:].reshape(n_panels, nsb, per_sb, 8, 1, 8 * spec.planes)  # [np, nsb, j, g, 1, 8P]
        if spec.planes == 1:  # [np, nsb, j, g, 8 bytes, 8 bits]: weight 8 byte + bit, i.e. 4c + i
            h = (high.reshape(*high.shape[:4], 8, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
        else:  # [np, nsb, j, g, 4 fields, 16 bytes]: weight 16 field + byte
            h = (high >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3
        q = q | (h.reshape(n_panels, nsb, per_sb, 8, PANEL, 4) << 4)
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(n_panels * PANEL, k)
    w = KBlockWeight(fmt, q, d, dmin, sc, mn).dequantize()
    return w[:n]

"""MXFP4 (OCP microscaling, as gpt-oss checkpoints ship their experts): blocks of 32 values along a row, each an
e2m1 float (4 bits: sign, 2 exponent bits, 1 mantissa bit) times the block's power of two, an e8m0 byte (2^(s - 127)).

A Hugging Face checkpoint stores a weight [..., rows, K] as `*_blocks` uint8 [..., rows, K/32, 16] (two values a
byte, the even-indexed one in the low nibble) and `*_scales` uint8 [..., rows, K/32]. Every value is exactly a bf16
(and a float32), so dequantizing is exact: what `dequantize` gives is what transformers' `convert_moe_packed_tensors`
gives. On the CPU the loader keeps them as blocks instead (`raw_blocks`: the kernels' MXFP4 format, kformats.py),
unless a block's scale is one the panels' fp16 cannot hold; then that expert loads dequantized.

`quantize` is the other way, to write such checkpoints (tests): each block's scale is the largest power of two that
keeps its largest value within e2m1's 6, and each value rounds to the nearest e2m1 value.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import kformats
from tokenmill.kernels.raw_blocks import RawBlocks

BLOCK = 32  # values per scale
# e2m1 code -> value: codes 8-15 are 0-7 negated
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales {list(scales.shape)} "
                         f"({scales.dtype}) must be uint8 [..., G, 16] and [..., G]")  # fmt: skip
    if blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks hold {BLOCK // 2} bytes each, not {blocks.shape[-1]}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    exponents = scales.to(torch.int32)[..., None] - 127  # [..., G, 1]
    return torch.ldexp(lut[codes], exponents).flatten(-2)


def raw_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> RawBlocks:
    """blocks uint8 [rows, G, 16], scales uint8 [rows, G] -> the same weight as a GGUF's MXFP4 blocks (the loader
    repacks them into the kernels' panels), or kformats.MXFP4ScaleError for a scale no fp16 holds."""
    numbers = kformats.mxfp4_from_hf(blocks, scales)
    return RawBlocks("mxfp4", kformats.encode_gguf_rows(numbers), numbers.shape[1])


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 rows must be a multiple of {BLOCK} long, not {weight.shape[-1]}")
    x = weight.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    top = x.abs().amax(dim=-1, keepdim=True)  # [..., G, 1]
    # 2^e with top / 2^e <= 6: e = ceil(log2(top / 6)), clamped to e8m0's range (an all-zero block takes 2^0)
    exponent = torch.where(top > 0, torch.ceil(torch.log2(top / 6.0)), torch.zeros_like(top)).clamp(-127, 127)
    scaled = x / torch.exp2(exponent)  # [..., G, 32], within [-6, 6]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., G, 32]: the nearest magnitude
    code = (code + 8 * (scaled < 0)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # [..., G, 16]
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)

"""Rotary position embeddings: the inverse frequencies of every `rope_type` the families use (default, linear,
llama3, yarn, longrope, GGUF's freq_factors), their cos/sin tables, and the rotation itself.

Shapes: T = tokens in the flattened batch, Dh = head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.model_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [Dh/2] and the cos/sin scale for each supported `rope_type` (HF's formulas)."""
    p = rope.params
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope.kind == "llama3":
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    if rope.kind == "freq_factors":  # a GGUF's `rope_freqs`: each frequency's divisor (llama3 scaling, precomputed)
        return inv_freq / torch.tensor(p["freq_factors"], dtype=torch.float32), 1.0
    if rope.kind == "longrope":  # the short factors; RotaryEmbedding switches to the long ones past the original length
        return _longrope_inv_freq(rope, head_dim, "short_factor")
    raise ValueError(f"rope type {rope.kind!r} is not supported")


def _longrope_inv_freq(rope: RopeConfig, head_dim: int, which: str) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency rescale factors (`short_factor` up to the pretraining length, then
    `long_factor`), and a cos/sin scale from the context extension ratio (HF's formulas)."""
    p = rope.params
    original = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or float(p.get("max_position_embeddings", original)) / original
    scale = p.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p[which], dtype=torch.float32)  # [Dh/2]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * rope.theta**exponents), float(scale)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    p = rope.params
    factor, orig_len = float(p["factor"]), float(p["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(orig_len / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin for the batch's positions, once per forward and shared by every layer."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        with torch.device("cpu"):  # (on the meta device, where models are built, `theta ** t` imports torch._dynamo:
            inv_freq, self.scale = rope_inv_freq(rope, head_dim)  # ~1.8 s of a start; `materialize` redoes it)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [Dh/2] float32
        # LongRoPE: positions from `long_from` on rotate by the long factors, and so does every position of a
        # sequence longer than the original context, which comes as -1 - p (long_below: HF's model picks the
        # factors by the length of a forward; a sequence that grows past it is computed again, as HF's Phi-3
        # `generate` does: engine/core.py). The engine's sequences never reach `long_from` with the short ones.
        self.long_from = rope.long_from
        long = _longrope_inv_freq(rope, head_dim, "long_factor")[0] if self.long_from is not None else None
        self.register_buffer("long_inv_freq", long, persistent=False)  # [Dh/2] float32, or None
        self._table = (torch.empty(0, head_dim), torch.empty(0, head_dim))  # CPU cos, sin [positions, Dh] float32

    def materialize(self, device: torch.device) -> None:
        """Recompute the buffers on `device` (the model was built on the meta device)."""
        self.inv_freq = rope_inv_freq(self.rope, self.head_dim)[0].to(device)
        if self.long_from is not None:
            self.long_inv_freq = _longrope_inv_freq(self.rope, self.head_dim, "long_factor")[0].to(device)
        self._table = (torch.empty(0, self.head_dim), torch.empty(0, self.head_dim))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type != "cpu":  # (no host sync: CUDA graphs capture this)
            cos, sin = self._compute(*long_below(positions)) if self.long_from is not None else self._compute(positions)
            return cos.to(dtype), sin.to(dtype)
        if self.long_from is not None and positions.numel() and int(positions.min()) < 0:
            cos, sin = self._compute(*long_below(positions))  # (a long prompt's prefill: not from the tables)
            return cos.to(dtype), sin.to(dtype)
        # on the CPU, rows of a table of every position so far: cos and sin of a handful of positions cost more
        # in torch's per-op overhead than the decode step's kernels of a small model (the same numbers either way)
        cos, sin = self.tables(int(positions.max()) + 1 if positions.numel() else 0)
        return cos[positions].to(dtype), sin[positions].to(dtype)

    def tables(self, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU tables of cos and sin, [>= top positions, Dh] float32 each, grown to hold positions < top."""
        if top > self._table[0].shape[0]:
            self._table = self._compute(torch.arange(max(top, 2 * self._table[0].shape[0], 256)))
        return self._table

    def _compute(
        self, positions: torch.Tensor, long: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T] (and [T] bool: rotate by the long factors) -> [T, Dh] float32 x2
        inv_freq = self.inv_freq[None, :]  # [1, Dh/2]
        if self.long_inv_freq is not None and self.long_from is not None:
            past = positions >= self.long_from if long is None else (positions >= self.long_from) | long  # [T]
            inv_freq = torch.where(past[:, None], self.long_inv_freq, inv_freq)  # [T, Dh/2]
        freqs = positions.float()[:, None] * inv_freq  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        return emb.cos() * self.scale, emb.sin() * self.scale


def long_below(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE's positions as the rows give them ([T] int64; -1 - p for a token of a sequence whose prompt passes
    the original context, forward/base.py) -> the positions [T] and which tokens rotate by the long factors [T]."""
    below = positions < 0
    return torch.where(below, -1 - positions, positions), below


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, Dh]; cos/sin: [T, Dh] (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

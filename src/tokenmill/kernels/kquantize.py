"""Our quantizers for the K family (`--quantization q4_k` and the rest, and the GGUF exporter): ggml's reference
algorithms (quantize_row_*_ref in ggml-quants.c, which llama-quantize runs without an importance matrix) in
vectorized torch, so a tensor quantized here holds the bits llama.cpp would give it.

Bit-equality needs ggml's float32 arithmetic in ggml's order: every sum below runs element by element, as its C
loop does (a torch reduction would add in another order, and round differently), and nearest_int is torch.round
(both round half to even). The legacy types are checked against the gguf package's quantizers byte for byte; the
K-quants against ggml's own, where a llama.cpp build is at hand (tests/unit/test_kquantize.py).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kernels.kformats import KSPECS, KBlockWeight


def _f32(value: np.floating | float) -> float:
    """A float32 value as a Python float: exact, so torch's float32 ops see the float32 number."""
    return float(np.float32(value))


def _rdiv(num: np.floating | float, t: torch.Tensor) -> torch.Tensor:
    """num / t in float32, one rounding as C's division (torch's `scalar / tensor` multiplies by t's reciprocal:
    two roundings, and now and then another float)."""
    return torch.full_like(t, _f32(num)) / t


def _div(t: torch.Tensor, den: float) -> torch.Tensor:
    """t / den in float32 with one rounding (torch's `tensor / scalar` may multiply by the reciprocal)."""
    return t / torch.full_like(t, _f32(den))


def _running_max(t: torch.Tensor) -> torch.Tensor:
    """[R, n] -> [R]: C's `float m = 0; if (v > m) m = v;` over each row (+0.0, never -0.0, where none is > 0)."""
    top = t.amax(dim=1)
    return torch.where(top > 0, top, torch.zeros_like(top))


def _seq_sum(terms: torch.Tensor) -> torch.Tensor:
    """[R, n] -> [R]: the terms added left to right in float32, as a C loop adds them."""
    total = terms[:, 0].clone()
    for i in range(1, terms.shape[1]):
        total = total + terms[:, i]
    return total


def _square(t: torch.Tensor) -> torch.Tensor:
    return t * t


def _qkx2(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's make_qkx2_quants over R sub-blocks x [R, n] with weights w: (scale [R], L [R, n], the_min [R])."""
    lo = torch.clamp(x.amin(dim=1), max=0.0)  # if (min > 0) min = 0
    hi = x.amax(dim=1)
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    iscale = _rdiv(nmax, span)
    scale = _rdiv(1.0, iscale)
    L = torch.round(iscale[:, None] * (x - lo[:, None])).clamp(0, nmax)
    best = _seq_sum(w * _square(scale[:, None] * L + lo[:, None] - x))
    for step in range(nstep + 1):
        span = torch.where(flat, torch.ones_like(hi), hi - lo)  # (min moves with each better fit, as in ggml)
        iscale = _rdiv(np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax), span)
        aux = torch.round(iscale[:, None] * (x - lo[:, None])).clamp(0, nmax)
        wl = w * aux
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * aux), _seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        cur = _seq_sum(w * _square(this_scale[:, None] * aux + this_min[:, None] - x))
        better = (det > 0) & (cur < best)
        L = torch.where(better[:, None], aux, L)
        best, scale = torch.where(better, cur, best), torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    L = torch.where(flat[:, None], torch.zeros_like(L), L)
    return torch.where(flat, torch.zeros_like(scale), scale), L, -lo


def _qx(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) over x [R, n]: (scale [R], L [R, n] in 0..2 nmax - 1)."""
    index = x.abs().argmax(dim=1, keepdim=True)  # the first of equal magnitudes, as its strict '>'
    top = x.gather(1, index)[:, 0]
    tiny = top.abs() < 1e-15  # GROUP_MAX_EPS
    top = torch.where(tiny, torch.ones_like(top), top)
    w = x * x

    def attempt(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lv = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        return lv, _seq_sum(w * x * lv), _seq_sum(w * lv * lv)

    lv, sumlx, suml2 = attempt(_rdiv(-nmax, top))
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(suml2))
    best = scale * sumlx
    for step in [*range(-9, 0), *range(1, 10)]:
        cand, sumlx, suml2 = attempt(_rdiv(-(np.float32(nmax) + np.float32(0.1) * np.float32(step)), top))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        lv = torch.where(better[:, None], cand, lv)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    L = torch.where(tiny[:, None], torch.zeros_like(lv), lv + nmax)
    return torch.where(tiny, torch.zeros_like(scale), scale), L


def _uint8(v: torch.Tensor) -> torch.Tensor:
    """C's (uint8_t) of an int: modulo 256."""
    return torch.remainder(v, 256)


def _k_superblocks(x: torch.Tensor, fmt: str) -> KBlockWeight:
    """quantize_row_q4_K_ref / _q5_K_ref over x [N, K] (K a multiple of 256)."""
    n, k = x.shape
    nmax, rmin, nstep = (15, -1.0, 20) if fmt == "q4_k" else (31, -0.5, 15)
    sub = x.reshape(-1, 32)  # [R * 8, 32]
    av = torch.sqrt(_div(_seq_sum(sub * sub), 32))
    scales, L, mins = _qkx2(sub, av[:, None] + sub.abs(), nmax, rmin, 0.1, nstep)
    scales, mins = scales.view(-1, 8), mins.view(-1, 8)
    max_scale, max_min = _running_max(scales), _running_max(mins)
    inv_scale = torch.where(max_scale > 0, _rdiv(63, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _rdiv(63, max_min), torch.zeros_like(max_min))
    ls = _uint8(torch.round(inv_scale[:, None] * scales)).clamp(max=63)
    lm = _uint8(torch.round(inv_min[:, None] * mins)).clamp(max=63)
    d, dmin = _div(max_scale, 63).half(), _div(max_min, 63).half()
    dd = (d.float()[:, None] * ls).view(-1)  # [R * 8]
    dm = (dmin.float()[:, None] * lm).view(-1)
    safe = torch.where(dd == 0, torch.ones_like(dd), dd)
    requant = torch.round((sub + dm[:, None]) / safe[:, None]).clamp(0, nmax)
    L = torch.where((dd == 0)[:, None], L, requant)  # if (!d) continue: the sub-block keeps its first L
    return KBlockWeight(fmt, L.to(torch.uint8).view(n, k), d.view(n, -1), dmin.view(n, -1),
                        ls.to(torch.int8).view(n, -1), lm.to(torch.uint8).view(n, -1))  # fmt: skip


def _q6_k(x: torch.Tensor) -> KBlockWeight:
    """quantize_row_q6_K_ref over x [N, K] (K a multiple of 256)."""
    n, k = x.shape
    sub = x.reshape(-1, 16)
    scales, L = _qx(sub, 32)
    scales = scales.view(-1, 16)  # [R, 16]
    index = scales.abs().argmax(dim=1, keepdim=True)
    max_scale = scales.gather(1, index)[:, 0]
    zero = max_scale.abs() < 1e-15
    iscale = _rdiv(-128, torch.where(zero, torch.ones_like(max_scale), max_scale))
    d = torch.where(zero, torch.zeros_like(iscale), _rdiv(1.0, iscale)).half()
    sc = torch.round(iscale[:, None] * scales).clamp(max=127)
    sc = torch.where(zero[:, None], torch.zeros_like(sc), sc)
    dd = (d.float()[:, None] * sc).view(-1)
    safe = torch.where(dd == 0, torch.ones_like(dd), dd)
    requant = torch.round(sub / safe[:, None]).clamp(-32, 31) + 32
    L = torch.where((dd == 0)[:, None], L, requant)
    L = torch.where(zero.repeat_interleave(16)[:, None], torch.zeros_like(L), L)  # an all-zero block: all bytes 0
    return KBlockWeight("q6_k", L.to(torch.uint8).view(n, k), d.view(n, -1), sc=sc.to(torch.int8).view(n, -1))


def _legacy(x: torch.Tensor, fmt: str) -> KBlockWeight:
    """quantize_row_q5_0_ref / _q5_1_ref / _q4_1_ref over x [N, K] (K a multiple of 32)."""
    n, k = x.shape
    b = x.reshape(-1, 32)
    if fmt == "q5_0":
        index = b.abs().argmax(dim=1, keepdim=True)  # the first of equal magnitudes
        d = _div(b.gather(1, index)[:, 0], -16)
        inv = torch.where(d != 0, _rdiv(1.0, d), torch.zeros_like(d))
        q = torch.trunc(b * inv[:, None] + _f32(16.5)).clamp(max=31)
        return KBlockWeight(fmt, q.to(torch.uint8).view(n, k), d.half().view(n, -1))
    top = 15 if fmt == "q4_1" else 31
    lo, hi = b.amin(dim=1), b.amax(dim=1)
    d = _div(hi - lo, top)
    inv = torch.where(d != 0, _rdiv(1.0, d), torch.zeros_like(d))
    q = torch.trunc((b - lo[:, None]) * inv[:, None] + _f32(0.5)).clamp(max=top)
    return KBlockWeight(fmt, q.to(torch.uint8).view(n, k), d.half().view(n, -1), (-lo.half()).view(n, -1))


def quantize_k(w: torch.Tensor, fmt: str) -> KBlockWeight:
    """A float weight [N, K] (K a multiple of the format's superblock) -> its blocks, as ggml's reference
    quantizer makes them."""
    spec = KSPECS[fmt]
    if spec.table:  # (ggml's IQ4 quantizer searches scales; the gguf package has no reference of it to match)
        raise ValueError(f"{fmt} weights load from GGUF files only: tokenmill does not quantize to {fmt}")
    if w.dim() != 2 or w.shape[1] % spec.sb:
        raise ValueError(f"{fmt} quantizes [N, K] weights with K a multiple of {spec.sb}, got {list(w.shape)}")
    x = w.detach().float().contiguous()
    if fmt in ("q4_k", "q5_k"):
        return _k_superblocks(x, fmt)
    return _q6_k(x) if fmt == "q6_k" else _legacy(x, fmt)

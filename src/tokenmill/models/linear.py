"""Linear kernels: how the model's weight matrices are stored and multiplied.

The model is built with `Linear`: an `nn.Linear` whose one-row product on the CPU is `torch.mv` (a decode step
at batch 1). Same numbers as `F.linear`, but in bfloat16 it streams the weight ~1.4x faster than the GEMM path
on the machine we measure on (scripts/gemv_microbench.py, docs/benchmarks.md).

`prepare_linears(model, quantization, device)` swaps every `nn.Linear` of the decoder stack (and the LM head)
for one of these:
- `PackedLinear` (`pack_weights=True`, CPU, float32/bfloat16, quantization="none"): the weight reordered once
  into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`), multiplied with `mkldnn._linear_pointwise`.
  Same numbers as `F.linear`. Off by default: on the Xeon we measure on it decodes slower than plain `F.linear`
  (docs/benchmarks.md has the numbers); it stays as a switch because other CPUs differ.
- `Int8Linear` (quantization="int8"): weight-only int8, symmetric per output channel
  (w ~= int8 * scale[n], scale = max|w[n, :]| / 127), activations stay in the model dtype;
  `torch._weight_int8pack_mm` on CPU (the kernel torchao's CPU int8 weight-only path also lands on).
- `Int4Linear` (quantization="int4"): weight-only int4, asymmetric in groups of 32 input channels,
  `torch._weight_int4pack_mm_for_cpu` (the kernel behind torchao's CPU int4 weight-only layout). CPU only.
Where a kernel is missing (CUDA, float16) the module keeps plain `F.linear`, on dequantized weights if need be.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import QUANTIZATION_MODES

INT4_GROUP_SIZE = 32
# The weight-only kernels are GEMVs at heart: their cost grows with every row of x, while a dense GEMM at
# small M costs about one pass over the weight. Above this many rows (prefill) the int8/int4 modules
# dequantize the weight and run the dense GEMM instead.
DEQUANT_ABOVE_ROWS = 8
QUANT_CHUNK_ROWS = 4096  # rows quantized at a time (bounds the load-time float32 temporaries)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
            y = torch.mv(self.weight, x[0])  # [N]
            return (y if self.bias is None else y + self.bias)[None]
        return F.linear(x, self.weight, self.bias)


@functools.cache
def packing_unsupported(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot pack `dtype` weights on this CPU, or None when it can.

    oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU it raises. We ask
    it once with a tiny matrix rather than guess from CPU flags, so the answer is oneDNN's own.
    """
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


class PackedLinear(nn.Module):
    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()  # [N, K]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1))  # oneDNN layout
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N] in `scale_dtype`), symmetric per output channel.

    The scales are rounded to `scale_dtype` (the kernel wants the activations' dtype) before the weights are
    divided by them, so q * scale reproduces w to half a step: a bfloat16 scale's own rounding (up to 0.4%)
    would otherwise scale the whole channel by the wrong amount. Rows go in chunks, so the float32
    temporaries stay small even for a 150k-row LM head.
    """
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=scale_dtype, device=w.device)
    for i in range(0, w.shape[0], QUANT_CHUNK_ROWS):
        w32 = w[i : i + QUANT_CHUNK_ROWS].float()
        s = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(scale_dtype)  # [rows]
        q[i : i + QUANT_CHUNK_ROWS] = torch.round(w32 / s.float()[:, None]).clamp(-128, 127).to(torch.int8)
        scales[i : i + QUANT_CHUNK_ROWS] = s
    return q, scales


class Int8Linear(nn.Module):
    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        q, scales = quantize_int8(linear.weight.detach(), self.dtype)
        self.register_buffer("qweight", q)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.kernel = linear.weight.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel and x2.shape[0] <= DEQUANT_ABOVE_ROWS:
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2, self.qweight.to(x.dtype) * self.scales[:, None], self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (uint4 values as int32 [N, K] in 0..15, scales [N, K/group], zeros [N, K/group]).

    Asymmetric min/max per group: w ~= (q - 8) * scale + zero, with zero the group's midpoint value, which is
    the convention `_weight_int4pack_mm_for_cpu` decodes (scale and zero packed as [K/group, N, 2]).
    """
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, K/group]
    scales = ((hi - lo) / 15.0).clamp(min=1e-8)
    zeros = lo + scales * 8.0
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(n, k), scales, zeros


class Int4Linear(nn.Module):
    qweight: torch.Tensor
    nibbles: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        w, dtype = linear.weight.detach(), linear.weight.dtype
        packed, nibbles, scales, zeros = [], [], [], []
        for i in range(0, w.shape[0], QUANT_CHUNK_ROWS):  # in row chunks: small int32/float32 temporaries
            q, s, z = quantize_int4(w[i : i + QUANT_CHUNK_ROWS], group)
            packed.append(torch._convert_weight_to_int4pack_for_cpu(q, 1))  # the kernel's layout is per row
            # the same nibbles in a layout we can unpack ourselves (the kernel's is opaque), for the prefill path
            nibbles.append((q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8))
            scales.append(s)
            zeros.append(z)
        self.register_buffer("qweight", torch.cat(packed))  # [N, K/2] kernel layout
        self.register_buffer("nibbles", torch.cat(nibbles))  # [N, K/2]
        sz = torch.stack([torch.cat(scales).t(), torch.cat(zeros).t()], dim=-1).contiguous().to(dtype)  # [K/g, N, 2]
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= DEQUANT_ABOVE_ROWS:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_and_zeros)
        else:
            y = F.linear(x2, self.dequantize(x2.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        n, k, g = self.out_features, self.in_features, self.group
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(n, k // g, g).to(dtype)
        scales, zeros = self.scales_and_zeros.unbind(-1)  # [K/g, N] each
        return ((q - 8) * scales.t()[..., None] + zeros.t()[..., None]).view(n, k)


def _supported(
    quantization: str, device: torch.device, dtype: torch.dtype, linear: nn.Linear, pack: bool = True
) -> str:
    """The kernel this linear gets: 'packed', 'int8', 'int4' or 'plain'."""
    if quantization == "int4":
        if device.type != "cpu" or dtype != torch.bfloat16:
            raise ValueError(
                "quantization='int4' runs only on the CPU in bfloat16 (its kernel's one form): use --dtype bfloat16"
            )
        if linear.in_features % INT4_GROUP_SIZE:
            raise ValueError(f"quantization='int4' needs in_features divisible by {INT4_GROUP_SIZE}")
        return "int4"
    if quantization == "int8":
        return "int8"
    cpu_dense = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if not (pack and cpu_dense):
        return "plain"
    reason = packing_unsupported(dtype)
    if reason is not None:
        dtype_name = str(dtype).removeprefix("torch.")
        raise ValueError(f"--pack-weights cannot pack {dtype_name} weights on this CPU ({reason}); "
                         "drop --pack-weights, or use --dtype float32")  # fmt: skip
    return "packed"


def prepare_linears(
    model: nn.Module, quantization: str, device: torch.device, pack_weights: bool = True
) -> dict[str, int]:
    """Replace every nn.Linear under `model` in place; returns how many linears got each kernel."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization={quantization!r} is not supported; allowed: {', '.join(QUANTIZATION_MODES)}")
    counts: dict[str, int] = {}
    # NOTE: hold on to parents only, so each replaced dense weight is freed as soon as its module is swapped
    for parent in [m for m in model.modules() if not isinstance(m, nn.Linear)]:
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            kind = _supported(quantization, device, child.weight.dtype, child, pack_weights)
            if kind == "plain":
                continue
            new: nn.Module = child
            if kind == "packed":
                new = PackedLinear(child)
            elif kind == "int8":
                new = Int8Linear(child)
            elif kind == "int4":
                new = Int4Linear(child)
            setattr(parent, name, new)
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every module's own parameters and buffers, once each, except the
    token embedding (a step reads one row of it; a tied LM head still counts it, through `lm_head`)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total

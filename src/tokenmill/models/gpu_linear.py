"""The GPU's linears beside torch's own: `CudaBlockLinear` (int8 / int4: ggml's blocks in a Triton kernel) and
`Fp8Linear` (`--quantization fp8`).

`Fp8Linear`, on a CUDA GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper), is W8A8 in float8: each
linear's weight is held as float8 e4m3 [N, K] with one float32 scale per output row (its absmax / 448, as vLLM's
fp8 with channel scales); each call quantizes the activations per row the same way (dynamic, no calibration) and
multiplies in `torch._scaled_mm` (row-wise scales: cuBLASLt on the GPU, fp32 accumulation, the scales applied in the
epilogue), so the weights are read as bytes, half of bf16's. The LM head stays in the model's dtype, as vLLM's.
With the GPU's Triton kernels (`--gpu-kernels`, the default) the activations are quantized in one launch
(kernels/cuda/fp8.py), else in torch's ops; every op runs on the device: a decode step's CUDA graph captures it.

The CPU has int8 (Q8_0 in tokenmill's kernels) instead: torch's CPU `_scaled_mm` is a reference implementation,
20-30x slower than bf16, so the CPU refuses fp8 (models/linear.py `_kind`). The tests run `Fp8Linear` on the CPU
all the same: the numbers are the GPU's, up to the order of the fp32 sums.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import CudaKernels, formats


class Blocks(Protocol):
    """What `CudaBlockLinear.from_kernel_linear` reads of a CPU `KernelLinear` (models/linear.py) holding blocks."""

    in_features: int
    format: str
    bias: torch.Tensor | None

    def packed(self) -> formats.PackedWeight: ...


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 e4m3 [M, K], float32 scales [M, 1]): each row over its absmax / 448 (all-zero rows: 1)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [M, 1]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ b) with W in float8 rows and x quantized per row at each call (module docstring)."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 ops: CudaKernels | None = None) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.ops = ops  # the GPU's Triton kernels: the activations quantized in one launch (kernels/cuda/fp8.py)
        self.register_buffer("weight", weight.contiguous())  # [N, K] float8 e4m3
        self.register_buffer("scale", scale.reshape(1, -1).float().contiguous())  # [1, N] float32
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())  # [N], the model's dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, ops: CudaKernels | None = None) -> Fp8Linear:
        """`linear`'s weight quantized per output row."""
        q, scale = quantize_rows(linear.weight.detach())
        return cls(q, scale, linear.bias, ops)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fp8 e4m3, row scales"

    def dequantized(self) -> torch.Tensor:  # [N, K] float32: the weight as the product sees it
        return self.weight.float() * self.scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        ops = self.ops if self.ops is not None and x2.device.type == self.ops.device_type else None
        q, sx = ops.fp8_rows(x2) if ops is not None else quantize_rows(x2)
        # scale_b [1, N] and the weight's transpose (column-major [K, N]): the layout cuBLASLt's row-wise FP8 takes.
        # A GPU writes row-wise scaled products in bf16 (torch refuses float32 out but on Hopper's cuBLAS 12.9+,
        # and float16 out in older releases): a float16 or float32 model's products are bf16, then its dtype
        out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16
        out = torch._scaled_mm(q, self.weight.t(), scale_a=sx, scale_b=self.scale, out_dtype=out_dtype).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def fp8_unavailable(device: torch.device) -> str | None:
    """Why `--quantization fp8` cannot run on `device`, or None where it can."""
    if device.type != "cuda":
        return "fp8 runs on a CUDA GPU with FP8 tensor cores; on the CPU use int8 (Q8_0 in tokenmill's kernels)"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper); this GPU is "
                f"{capability[0]}.{capability[1]}: use int8")  # fmt: skip
    return None


class CudaBlockLinear(nn.Module):
    """A q8_0 / q4_0 weight on a GPU, multiplied by the Triton kernel that reads its int8 values in place
    (kernels/cuda/int8.py): weight-only, W8A16. The values are the CPU path's and a GGUF's (ggml's blocks), held as
    int8 q [N, K'] and float32 scales d [N, K'/32]; q4_0's values take a byte each too (no 4-bit GPU kernel yet)."""

    q: torch.Tensor
    d: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, fmt: str, in_features: int,
                 ops: CudaKernels) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.format, self.ops = in_features, q.shape[0], fmt, ops
        self.register_buffer("q", q.contiguous())  # [N, K'] int8
        self.register_buffer("d", d.float().contiguous())  # [N, K'/32] float32
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())  # [N] float32

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, ops: CudaKernels) -> CudaBlockLinear:
        """`linear`'s weight quantized as the CPU path quantizes it (formats.quantize_q8_0 / _q4_0)."""
        w = linear.weight.detach()
        k = w.shape[1]
        w = F.pad(w.float(), (0, -k % formats.BLOCK))  # [N, K'] zero columns up to whole blocks
        if fmt == "q8_0":
            q, d = formats.quantize_q8_0(w)
        else:
            q4, d = formats.quantize_q4_0(w)
            q = (q4.to(torch.int16) - 8).to(torch.int8)  # -8..7
        return cls(q, d, linear.bias, fmt, k, ops)

    @classmethod
    def from_kernel_linear(cls, linear: Blocks, ops: CudaKernels) -> CudaBlockLinear:
        """A GGUF's blocks (loaded as a `KernelLinear`), the same numbers in the GPU's layout, on the kernels' device
        (a KernelLinear made on the CPU left them there, where the GPU's kernels cannot read them)."""
        q, d = (t.to(ops.device_type) for t in formats.unpack_blocks(linear.packed()))
        bias = None if linear.bias is None else linear.bias.to(ops.device_type)
        return cls(q, d, bias, linear.format, linear.in_features, ops)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format}, triton"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype, device=x2.device)
        self.ops.q8_linear(x2, self.q, self.d, self.bias, out)
        return out.view(*x.shape[:-1], self.out_features)

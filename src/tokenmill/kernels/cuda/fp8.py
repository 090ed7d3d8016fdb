"""`--quantization fp8`'s activations, quantized per row in one launch (models/gpu_linear.py `Fp8Linear`).

Each row's scale is its float32 absmax / 448 (1 for an all-zero row) and each value x / scale, clamped to e4m3's
range and rounded to nearest even: the numbers `gpu_linear.quantize_rows` gives through seven torch kernels (the
float copy, abs, amax, the division, the zero rows' 1, the division, the clamp and the cast), which on the H200 were
676 of the 0.5B shape's 1238 kernels a step. The divisions are IEEE-rounded (`div_rn`), as torch's are.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value (a constexpr: kernels read no other globals)


@triton.jit
def _fp8_rows(x_ptr, q_ptr, scale_ptr, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    top = tl.zeros([BLOCK], tl.float32)
    for start in range(0, K, BLOCK):  # the row's absmax, a block at a time
        x = tl.load(x_ptr + row * K + start + i, mask=start + i < K, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    scale = tl.math.div_rn(tl.max(top, axis=0), FP8_MAX)
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + i < K
        x = tl.load(x_ptr + row * K + start + i, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * K + start + i, q.to(tl.float8e4nv), mask=mask)


def launch_fp8_rows(x: Tensor, q: Tensor, scale: Tensor) -> None:
    """x [M, K] contiguous (bf16, fp16 or float32) -> q [M, K] float8 e4m3, scale [M, 1] float32."""
    rows, k = x.shape
    _fp8_rows[(rows,)](x, q, scale, k, BLOCK=min(1024, triton.next_power_of_2(k)))

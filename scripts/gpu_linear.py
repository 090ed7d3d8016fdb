"""The GPU's int8 product (kernels/cuda/int8.py) against torch's bf16 one, alone, at the Llama-3.1-8B shapes and a
few row counts: each product's time (CUDA events, the mean of 50 after a warm-up) and the weight bytes it reads
per second.

    python scripts/gpu_linear.py
"""

from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F
from gpu_step import cuda_ms  # scripts/, beside this file

from tokenmill.kernels import formats
from tokenmill.kernels.cuda import CudaKernels

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def main() -> None:
    ops = CudaKernels()
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        q, d = formats.quantize_q8_0(w)
        d = d.float()
        wb = w.to(torch.bfloat16)
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            t8 = cuda_ms(functools.partial(ops.q8_linear, x, q, d, None, out), 50)
            t16 = cuda_ms(functools.partial(F.linear, x, wb), 50)
            print(json.dumps(dict(
                shape=name, n=n, k=k, m=m, int8_ms=round(t8, 4), bf16_ms=round(t16, 4), speedup=round(t16 / t8, 2),
                int8_gbs=round((q.numel() + d.numel() * 4) / t8 / 1e6), bf16_gbs=round(wb.numel() * 2 / t16 / 1e6),
            )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""The GPU's int8 product (kernels/cuda/int8.py) against torch's bf16 one, alone, at the Llama-3.1-8B shapes and a
few row counts: each product's time (CUDA events, the mean of 50 after a warm-up) and the weight bytes it reads
per second.

    python scripts/gpu_linear.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from tokenmill.kernels import formats
from tokenmill.kernels.cuda import CudaKernels

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def _ms(fn, repeat: int = 50) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


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
            t8 = _ms(lambda x=x, out=out, q=q, d=d: ops.q8_linear(x, q, d, None, out))
            t16 = _ms(lambda x=x, wb=wb: F.linear(x, wb))
            print(json.dumps(dict(
                shape=name, n=n, k=k, m=m, int8_ms=round(t8, 4), bf16_ms=round(t16, 4), speedup=round(t16 / t8, 2),
                int8_gbs=round((q.numel() + d.numel() * 4) / t8 / 1e6), bf16_gbs=round(wb.numel() * 2 / t16 / 1e6),
            )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

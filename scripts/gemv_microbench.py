"""Microbenchmark behind the `torch.mv` choice in models/linear.py: one-row products over DRAM-resident weights.

    .venv/bin/python scripts/gemv_microbench.py [--layers 24]

Runs one qwen2.5-0.5b-shaped layer's four projections for 24 distinct layers (716 MB of bfloat16, far more
than the CPU's caches, as in a real decode step) through F.linear, x @ W.t(), oneDNN-prepacked weights and
torch.mv, and prints the bandwidth each streams the weights at. This explains a kernel choice; what tokenmill
delivers is measured by `tokenmill bench` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down: [N, K]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    torch.manual_seed(0)
    weights = [[torch.randn(n, k, dtype=torch.bfloat16) for n, k in SHAPES] for _ in range(a.layers)]
    transposed = [[w.t().contiguous() for w in layer] for layer in weights]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in layer] for layer in weights]
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    x = {k: torch.randn(1, k, dtype=torch.bfloat16) for _, k in SHAPES}
    kernels = {
        "F.linear": lambda i, j: F.linear(x[SHAPES[j][1]], weights[i][j]),
        "x @ W.t()": lambda i, j: x[SHAPES[j][1]] @ transposed[i][j],
        "oneDNN packed": lambda i, j: torch.ops.mkldnn._linear_pointwise(
            x[SHAPES[j][1]], packed[i][j], None, "none", [], ""
        ),
        "torch.mv": lambda i, j: torch.mv(weights[i][j], x[SHAPES[j][1]][0]),
    }
    print(f"{nbytes / 1e6:.0f} MB of bf16 weights, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        for name, fn in kernels.items():
            for _ in range(2):  # warm
                for i in range(a.layers):
                    for j in range(len(SHAPES)):
                        fn(i, j)
            start = time.perf_counter()
            for _ in range(a.repeat):
                for i in range(a.layers):
                    for j in range(len(SHAPES)):
                        fn(i, j)
            dt = (time.perf_counter() - start) / a.repeat
            print(f"{name:14s} {dt * 1000:7.1f} ms per pass  {nbytes / dt / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()

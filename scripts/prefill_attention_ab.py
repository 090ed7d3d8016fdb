"""Time the prefill attention kernel (one layer's call) for Qwen2.5-0.5B's heads (14 query, 2 KV, Dh 64) over a
random paged bf16 cache, several kernel source trees alternated in one process, so that a shared machine's drift hits
them alike; and check that their outputs are equal.

    # two copies of src/tokenmill/kernels/csrc, one edited; cases are NEW:CONTEXT (the new tokens end the context)
    .venv/bin/python scripts/prefill_attention_ab.py --trees /tmp/A,/tmp/B --level avx2 --cases 512:8704,2048:4096

The cache's blocks are in a random order, as a long-running pool's are; the median of --reps calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tokenmill.kernels import build
from tokenmill.kernels.ops import Kernels

H, HKV, DH, BLOCK = 14, 2, 64, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="kernel source folders, comma-separated")
    p.add_argument("--level", default="avx2", help="the kernel variant (isa.LEVELS)")
    p.add_argument("--cases", default="512:8704,512:2048,2048:4096,64:4096", help="NEW:CONTEXT, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    kernels: dict[str, Kernels] = {}
    for tree in args.trees.split(","):
        build.CSRC = Path(tree)
        kernels[tree] = Kernels(build.load(args.level), args.level, build.layout_key(args.level))
    torch.manual_seed(0)
    for case in args.cases.split(","):
        new, ctx = (int(n) for n in case.split(":"))
        blocks = (ctx + BLOCK - 1) // BLOCK
        cache = (torch.randn(2, blocks * BLOCK, HKV, DH) * 0.5).to(torch.bfloat16)  # [2, slots, Hkv, Dh]
        tables = torch.randperm(blocks).view(1, blocks)  # [1, blocks] int64
        seqs = torch.tensor([[0, new, ctx]])  # first row, new tokens, context length
        q = torch.randn(new, H, DH).to(torch.bfloat16)  # [new, H, Dh]
        outs = {tree: torch.empty(new, H, DH, dtype=torch.bfloat16) for tree in kernels}
        times: dict[str, list[float]] = {tree: [] for tree in kernels}
        for _ in range(args.reps):
            for tree, ops in kernels.items():
                start = time.perf_counter()
                ops.prefill_attention(q, cache, tables, seqs, BLOCK, None, outs[tree])
                times[tree].append(time.perf_counter() - start)
        flops = 4 * H * DH * new * (ctx - new / 2)  # q.k and p.v over the causal span
        cells = [f"{Path(t).name} {statistics.median(v) * 1e3:.1f} ms ({flops / statistics.median(v) / 1e9:.0f} "
                 "GFLOP/s)" for t, v in times.items()]  # fmt: skip
        first = next(iter(outs.values()))
        equal = all(torch.equal(first, o) for o in outs.values())
        print(f"{new} new over {ctx}: {', '.join(cells)}; outputs equal: {equal}", flush=True)


if __name__ == "__main__":
    main()

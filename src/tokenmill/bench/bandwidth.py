"""The machine's memory read bandwidth, for judging a decode's GB/s: at batch 1 every step reads every weight once,
so tg tok/s x weight bytes can reach at most what the memory delivers.
"""

from __future__ import annotations

import time


def read_bandwidth_gb_s(megabytes: int = 1024, repeats: int = 5) -> float:
    """The best of `repeats` reads of a buffer far larger than the caches, on torch's threads: tokenmill's own
    streaming kernel where it is built, else torch's sum over the buffer."""
    import torch

    from tokenmill import kernels

    ops = kernels.active()
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    read = (lambda: ops.module.read_sum(buf.data_ptr(), buf.numel() * 4)) if ops is not None else buf.sum
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        start = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9

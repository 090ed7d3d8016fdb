"""The memory read bandwidth of the device the weights live on, for judging a decode's GB/s: at batch 1 every step
reads every weight once, so tg tok/s x weight bytes can reach at most what that memory delivers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def read_bandwidth_gb_s(megabytes: int = 1024, repeats: int = 5, device: str = "cpu") -> float:
    """Host memory (`device` cpu) or a GPU's memory (cuda, cuda:N: `_gpu_read_gb_s`).

    On the CPU: the best of `repeats` reads of a buffer far larger than the caches, on torch's threads: tokenmill's own
    streaming kernel where it is built, else torch's sum over the buffer. The buffer lives in memory of the kind the
    packed weights do (one huge-page region where the platform has one: kernels/placement.py), so that a decode
    is judged against what that memory delivers (Zen 4: 31-34 GB/s against 30-32 from torch.ones, runs alternated).
    """
    import torch

    if device != "cpu":
        return _gpu_read_gb_s(torch.device(device), repeats)
    probe = cpu_prober(megabytes)
    probe(1)  # the first pass faults the pages in
    return probe(repeats)


def cpu_prober(megabytes: int) -> Callable[[int], float]:
    """`read_bandwidth_gb_s`'s CPU probe over one buffer that stays allocated: probe(repeats) -> the best of that
    many reads, GB/s (for a tool that probes again and again, `scripts/stack_ab.py --probe`)."""
    import torch

    from tokenmill import kernels
    from tokenmill.kernels.placement import huge_page_buffer

    ops = kernels.active()
    nbytes = megabytes * 2**20
    region = huge_page_buffer(nbytes)
    buf = torch.ones(nbytes // 4, dtype=torch.float32) if region is None else region.view(torch.float32).fill_(1.0)
    read = (lambda: ops.module.read_sum(buf.data_ptr(), buf.numel() * 4)) if ops is not None else buf.sum

    def probe(repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best / 1e9

    return probe


def _gpu_read_gb_s(device: torch.device, repeats: int) -> float:
    """The best of `repeats` sums over 4 GiB of the GPU's memory (far past its L2), timed with CUDA events: a
    read-only stream, as a decode step's weights are."""
    import torch

    buf = torch.ones(2**30, dtype=torch.float32, device=device)  # 4 GiB
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms the kernel up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buf.sum()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del buf
    torch.cuda.empty_cache()
    return 4 * 2**30 / best / 1e9

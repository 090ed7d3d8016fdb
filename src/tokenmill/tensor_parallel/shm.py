"""An all-reduce through shared memory, for tensor-parallel ranks on one machine.

gloo's all-reduce goes through TCP loopback and the peers' threads waking up: on a 2-vCPU VM it takes ~1.6 ms
even for 896 floats, and a decode step of a 24-layer model makes 48 of them. Here each rank writes its partial
sum into its row of a shared buffer, publishes a sequence number, spins until every peer has published the
same one, and sums the rows, every rank in the same order, so every rank holds bitwise the same result.

Two buffers alternate by the sequence number's parity: a rank writes buffer s % 2 only after every peer has
published s - 1, which it does only after it finished reading step s - 2, the last user of that buffer.
x86 keeps stores in order (data, then the flag), which is what the reader relies on.

A rank that dies would leave the others spinning: while they wait they ask `alive` (rank 0: its worker
processes; a worker: its parent), and raise when it says no, or after TIMEOUT_S.

Tensors larger than a buffer (prefill chunks) take torch.distributed's all-reduce: whether a tensor fits is
the same on every rank, so the ranks always pick the same path.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

TIMEOUT_S = 120.0  # as the gloo group's timeout
MAX_ELEMS = 1 << 18  # floats per rank per buffer (1 MiB): a decode batch's hidden states
_FLAG_STRIDE = 16  # int64s between ranks' flags: one cache line each


class ShmAllReduce:
    def __init__(self, rank: int, size: int, name: str, alive: Callable[[], bool] = lambda: True) -> None:
        """`alive`: whether the other ranks still run (asked while waiting on them; False raises)."""
        self.rank, self.size, self.seq, self.alive = rank, size, 0, alive
        self.path = f"/dev/shm/tokenmill-tp-{name}"
        data_elems, flag_elems = 2 * size * MAX_ELEMS, size * _FLAG_STRIDE
        if rank == 0:
            with open(self.path, "wb") as f:
                f.truncate(data_elems * 4 + flag_elems * 8)
        dist.barrier()  # the file exists
        nbytes = data_elems * 4 + flag_elems * 8
        raw = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        self.data = raw[: data_elems * 4].view(torch.float32).view(2, size, MAX_ELEMS)  # [parity, rank, elems]
        self.flags = raw[data_elems * 4 :].view(torch.int64)  # rank r's sequence number at r * _FLAG_STRIDE
        dist.barrier()  # everyone has it mapped: the name can go
        if rank == 0:
            os.unlink(self.path)

    @staticmethod
    def supported() -> bool:
        """x86 only: the protocol needs stores to stay in order (elsewhere the ranks keep gloo's all-reduce)."""
        return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

    @staticmethod
    def new_name() -> str:
        return uuid.uuid4().hex

    def __call__(self, y: torch.Tensor) -> None:
        """Sum `y` over the ranks, in place."""
        n = y.numel()
        if n > MAX_ELEMS or y.device.type != "cpu":
            dist.all_reduce(y)
            return
        self.seq += 1
        buf = self.data[self.seq % 2]  # [size, elems]
        buf[self.rank, :n].copy_(y.reshape(-1))
        self.flags[self.rank * _FLAG_STRIDE] = self.seq  # publish, after the data
        for peer in range(self.size):
            spins, since = 0, 0.0
            while int(self.flags[peer * _FLAG_STRIDE]) < self.seq:
                spins += 1
                if spins > 1000:
                    time.sleep(0)  # a peer that lost its core needs this one
                if spins % 20000 == 0:  # every few milliseconds: is the peer still there?
                    since = since or time.monotonic()
                    if not self.alive() or time.monotonic() - since > TIMEOUT_S:
                        raise RuntimeError(f"tensor-parallel rank {peer} stopped answering (all-reduce {self.seq})")
        total = buf[0, :n].clone()
        for peer in range(1, self.size):
            total += buf[peer, :n]
        y.copy_(total.view(y.shape))

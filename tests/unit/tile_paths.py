"""The tile paths a kernel variant runs here: its vector tiles, and AMX's where this CPU and Linux allow them (the
compiled module's switch, `set_amx`, chooses; -1 is the default, AMX wherever it is allowed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokenmill import kernels


def tile_modes(ops: kernels.Kernels) -> list[int]:
    """0: the vector tiles; -1: the default, which is AMX's on a CPU that has them (else the vector tiles again)."""
    return [0, -1] if ops.module.amx_native() else [-1]


@contextmanager
def amx_mode(ops: kernels.Kernels, mode: int) -> Iterator[None]:
    previous = ops.set_amx(mode)
    try:
        yield
    finally:
        ops.set_amx(previous)

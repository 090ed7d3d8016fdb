"""The `ops` fixture: tokenmill's compiled kernels, once for every variant (those this CPU lacks skip, saying so); and
every unit test starts from the kernels' default tile paths."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenmill import kernels
from tokenmill.kernels.build import EMULATED
from tokenmill.kernels.isa import _REQUIRED_FLAGS, LEVELS, cpu_flags, supported_levels


def kernel_levels() -> list[str]:
    """The variants this CPU runs (the tests that take a level as a plain parameter run these)."""
    levels = supported_levels()
    if "avx2" in levels and "avx512" not in levels:
        levels.append(EMULATED)  # the AVX-512 variant's 16-lane logic, on this AVX2 CPU
    return levels


def _every_level() -> list[str]:
    return [*LEVELS, *(lv for lv in kernel_levels() if lv not in LEVELS)]


@pytest.fixture(scope="module", params=_every_level())
def ops(request: pytest.FixtureRequest) -> kernels.Kernels:
    if request.param not in kernel_levels():
        missing = ", ".join(sorted(_REQUIRED_FLAGS[request.param] - cpu_flags())) or "an x86-64 CPU"
        pytest.skip(f"the {request.param} kernels need {missing}, which this CPU lacks")
    try:
        return kernels.variant(request.param)
    except kernels.KernelBuildError as e:  # pragma: no cover - a machine without a compiler
        pytest.skip(f"the {request.param} kernels cannot be built here: {e}")


@pytest.fixture(autouse=True)
def default_tile_paths() -> Iterator[None]:
    """AMX's switch is the process's, and a batch-invariant model (parity tests, in the same worker) turns it off
    and leaves it off: each unit test starts from the default (AMX where the CPU has it), and gives the switch back."""
    try:
        ops = kernels.variant("avx512bf16") if "avx512bf16" in supported_levels() else None
    except kernels.KernelBuildError:  # pragma: no cover - no compiler here: the `ops` tests skip, saying why
        ops = None
    if ops is None:
        yield
        return
    previous = ops.set_amx(-1)
    try:
        yield
    finally:
        ops.set_amx(previous)

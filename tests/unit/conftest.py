"""The `ops` fixture: tokenmill's compiled kernels, once for every variant this CPU runs."""

from __future__ import annotations

import pytest

from tokenmill import kernels
from tokenmill.kernels.build import EMULATED
from tokenmill.kernels.isa import supported_levels


def kernel_levels() -> list[str]:
    levels = supported_levels()
    if "avx2" in levels and "avx512" not in levels:
        levels.append(EMULATED)  # the AVX-512 variant's 16-lane logic, on this AVX2 CPU
    return levels


@pytest.fixture(scope="module", params=kernel_levels())
def ops(request: pytest.FixtureRequest) -> kernels.Kernels:
    try:
        return kernels.variant(request.param)
    except kernels.KernelBuildError as e:  # pragma: no cover - a machine without a compiler
        pytest.skip(f"the {request.param} kernels cannot be built here: {e}")

"""The device the parity and engine tests run their models on.

CI runs them on the CPU (the default). `pytest --device cuda` (scripts/test_cuda.sh) runs the same tests on a
GPU, and skips, saying so, the tests of the CPU kernels. conftest.py sets DEVICE from the option.
"""

from __future__ import annotations

import pytest
import torch

DEVICE = "cpu"


def ids_tensor(ids: list[int]) -> torch.Tensor:  # [T] int64, on DEVICE
    return torch.tensor(ids, device=DEVICE)


def positions(start: int, end: int) -> torch.Tensor:  # [end - start] int64, on DEVICE
    return torch.arange(start, end, device=DEVICE)


def cpu_only(what: str = "a test of the CPU kernels") -> None:
    """Skip a test of something only the CPU has when the run targets another device."""
    if DEVICE != "cpu":
        pytest.skip(f"{what}: the --device {DEVICE} run leaves it to the CPU run")

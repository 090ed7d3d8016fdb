"""tokenmill's own CPU kernels: linear layers over packed bf16 / Q8_0 / Q4_0 weights, compiled per ISA.

`active()` is the compiled module for the variant this CPU runs (see isa.py), built on first use (build.py). A
variant that cannot be built here (a compiler too old for its flags) gives way to the next lower one the CPU
runs, and when none builds (no compiler) tokenmill runs on the pure-torch path; either way it says so once, in
one line. `status()` says which path is active and why (`tokenmill env` prints it).
"""

from __future__ import annotations

import logging
import sys
from functools import cache
from typing import Any

from tokenmill.kernels.build import KernelBuildError, build_key, cache_root, layout_key, load
from tokenmill.kernels.cuda import CudaKernels
from tokenmill.kernels.isa import LANES, LEVELS, choose, cpu_flags, cpu_name, supported_levels
from tokenmill.kernels.ops import Kernels

# the fused ops a model's layers and the paged KV cache call: the CPU's compiled kernels or the GPU's Triton ones
FusedOps = Kernels | CudaKernels

log = logging.getLogger("tokenmill.kernels")


@cache
def variant(level: str) -> Kernels:
    """The compiled kernels of one variant (tests run every variant the CPU supports)."""
    return Kernels(load(level), level, layout_key(level))


@cache
def _active() -> tuple[Kernels | None, str]:
    """(the kernels that run, or None; "" when they are the chosen variant's, else why not)"""
    choice = choose()
    lower = [lv for lv in reversed(supported_levels()) if LEVELS.index(lv) < LEVELS.index(choice.level)]
    failure = None
    for level in [choice.level, *lower]:
        try:
            ops = variant(level)
        except KernelBuildError as e:
            failure = failure or e
            continue
        if level == choice.level:
            return ops, ""
        reason = f"the {choice.level} kernels could not be built ({failure}); running the {level} kernels"
        print(f"tokenmill: {reason}", file=sys.stderr, flush=True)
        return ops, reason
    reason = f"the {choice.level} kernels could not be built ({failure}); running on the pure-torch path"
    print(f"tokenmill: {reason}", file=sys.stderr, flush=True)
    return None, reason


def active() -> Kernels | None:
    return _active()[0]


def status() -> dict[str, Any]:
    """What runs and why, for `tokenmill env` and the bench records."""
    choice = choose()
    module, failure = _active()
    level = module.level if module is not None else choice.level
    return {
        "cpu": cpu_name(),
        "isa_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))),
        "supported": supported_levels(),
        "kernels": level if module is not None else "pure-torch",
        "why": failure or choice.reason,
        "lanes": LANES[level] if module is not None else None,
        "amx_tiles": bool(module is not None and module.module.amx_native()),  # from a few rows (amx.h)
        "cache": str(cache_root() / build_key(level)),
    }


__all__ = ["LEVELS", "CudaKernels", "FusedOps", "KernelBuildError", "Kernels", "active", "status", "variant"]

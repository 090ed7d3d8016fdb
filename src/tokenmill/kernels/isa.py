"""Which kernel variant this CPU runs, and why.

Variants, lowest first: `scalar` (portable C++ vectors, 4 lanes: SSE2 on x86-64, NEON on arm64), `avx2` (AVX2 +
FMA + F16C, 8 lanes), `avxvnni` (that plus AVX-VNNI: the quantized formats' 8-bit products by the VEX `vpdpbusd`
of Intel's client cores from Alder Lake on, which have no AVX-512), `avx512` (AVX-512 F/BW/VL/DQ, 16 lanes:
Skylake-SP), `avx512vnni` (that plus AVX-512 VNNI: the quantized formats' 8-bit products by the zmm `vpdpbusd`,
bf16 weights widened to float32 for FMAs; Cascade Lake and Ice Lake, the most common cloud Xeons) and
`avx512bf16` (that plus AVX-512 BF16: bf16 pairs multiplied by `vdpbf16ps`, and AMX where the CPU has it; Zen 4/5,
Cooper Lake, Sapphire Rapids and later). The CPU's best is picked from the flags the kernel reports;
`TOKENMILL_ISA=<variant>` forces a lower one (to test each path on a bigger machine).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

LEVELS = ("scalar", "avx2", "avxvnni", "avx512", "avx512vnni", "avx512bf16")
LANES = {"scalar": 4, "avx2": 8, "avxvnni": 8, "avx512": 16, "avx512vnni": 16, "avx512bf16": 16}
COMPILE_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
COMPILE_FLAGS["avxvnni"] = [*COMPILE_FLAGS["avx2"], "-mavxvnni"]
COMPILE_FLAGS["avx512vnni"] = [*COMPILE_FLAGS["avx512"], "-mavx512vnni"]
COMPILE_FLAGS["avx512bf16"] = [*COMPILE_FLAGS["avx512"], "-mavx512bf16", "-mavx512vnni"]  # (this order: its build key)
_REQUIRED_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avxvnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"},
    "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "fma", "f16c"},
}
ENV = "TOKENMILL_ISA"


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (Linux); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_levels() -> list[str]:
    """Every variant this CPU can run, lowest first."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = cpu_flags()
    return ["scalar"] + [lv for lv in LEVELS[1:] if x86 and _REQUIRED_FLAGS[lv] <= flags]


@dataclass(frozen=True)
class Choice:
    level: str
    reason: str


def choose() -> Choice:
    """The variant to run: the CPU's best, or a lower one that TOKENMILL_ISA asks for."""
    supported = supported_levels()
    best = supported[-1]
    forced = os.environ.get(ENV, "").strip().lower()
    if not forced:
        return Choice(best, f"the best this CPU supports ({', '.join(supported)})")
    if forced not in LEVELS:
        raise ValueError(f"{ENV}={forced!r} is not a kernel variant; allowed: {', '.join(LEVELS)}")
    if forced not in supported:
        raise ValueError(f"{ENV}={forced!r} needs CPU features this CPU lacks; it supports {', '.join(supported)}")
    return Choice(forced, f"forced by {ENV} (the CPU supports {', '.join(supported)})")

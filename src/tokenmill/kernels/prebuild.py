"""Compile kernel variants ahead of time, into the cache, whatever this CPU runs: `python -m
tokenmill.kernels.prebuild avx2 avx512` (the container image's build does this).

`build.load` compiles with torch's `cpp_extension.load`, which then imports the module; a variant whose
instructions this CPU lacks (AVX-512 on an AVX2 build machine) could die by SIGILL there. So each variant builds
in a child process, and one that the CPU cannot run counts as built once its module is in the cache, whatever
became of the child's import. Prints one line per variant; exits 1 if any did not build.
"""

from __future__ import annotations

import subprocess
import sys

from tokenmill.kernels.build import build_key, cache_root
from tokenmill.kernels.isa import LEVELS, supported_levels


def prebuild(level: str) -> str:
    """Build `level` in a child process; return what became of it, in a few words ("" if it did not build)."""
    code = f"from tokenmill.kernels.build import load; load({level!r})"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    built = any((cache_root() / build_key(level)).glob("tokenmill_kernels_*.so"))
    if child.returncode == 0:
        return "built and loaded"
    if built and level not in supported_levels():
        return f"built (not loaded: this CPU cannot run it; the child exited {child.returncode})"
    lines = child.stderr.strip().splitlines() or [f"exit status {child.returncode}"]
    why = next((x for x in lines if "error:" in x and "Error building" not in x), lines[-1])  # the compiler's
    print(f"tokenmill: the {level} kernels did not build: {why.strip()}", file=sys.stderr, flush=True)
    return ""


def main(argv: list[str]) -> int:
    wrong = [lv for lv in argv if lv not in LEVELS]
    if not argv or wrong:
        print(f"usage: python -m tokenmill.kernels.prebuild LEVEL...; allowed: {', '.join(LEVELS)}"
              + (f" (not {', '.join(wrong)})" if wrong else ""), file=sys.stderr)  # fmt: skip
        return 2
    failed = 0
    for level in argv:
        outcome = prebuild(level)
        print(f"tokenmill: {level} kernels: {outcome or 'FAILED'}", flush=True)
        failed += not outcome
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

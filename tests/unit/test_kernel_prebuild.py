"""`python -m tokenmill.kernels.prebuild LEVEL...` (the image's build step): each variant compiles in a child
process and lands in the cache; a wrong level is one line naming the allowed ones. (The case it exists for, an
AVX-512 variant built on a CPU without AVX-512, needs such a CPU: the image build on one is its test.)"""

from __future__ import annotations

import subprocess
import sys

from tokenmill.kernels.build import build_key, cache_root
from tokenmill.kernels.isa import choose


def _prebuild(*levels: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.kernels.prebuild", *levels], capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def test_the_cpus_variant_is_built_into_the_cache() -> None:
    level = choose().level  # the variant the session's kernel tests build anyway: usually cached already
    run = _prebuild(level)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"tokenmill: {level} kernels: built and loaded"
    assert any((cache_root() / build_key(level)).glob("tokenmill_kernels_*.so"))


def test_a_wrong_level_is_one_line() -> None:
    run = _prebuild("avx2", "avx1024")
    assert run.returncode == 2 and run.stdout == ""
    [line] = run.stderr.splitlines()
    assert "avx1024" in line and "avx512" in line, line

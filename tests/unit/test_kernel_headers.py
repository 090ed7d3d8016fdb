"""Every header of the C++ kernels (kernels/csrc/) compiles on its own: it includes what it uses, in any order a
reader might include it. Each is checked with `c++ -fsyntax-only` and the flags and include paths build.py gives
the compiler: this machine's variant for the portable headers, and for a per-ISA header under arch/<variant>/ that
variant's flags (a syntax check needs the compiler's support for them, not the CPU's). No kernel is built."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tokenmill.kernels import build
from tokenmill.kernels.isa import choose

HEADERS = sorted(path.relative_to(build.CSRC).as_posix() for path in build.CSRC.rglob("*.h"))
# the variant whose flags each arch/ folder's headers are written for (kernels/isa.py's levels)
ARCH_LEVELS = {
    "generic": "scalar",
    "avx2": "avx2",
    "avxvnni": "avxvnni",
    "avx512": "avx512",
    "avx512bf16": "avx512bf16",
    "amx": "avx512bf16",
}
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _level(header: str) -> str:
    parts = header.split("/")
    if parts[0] != "arch" or len(parts) < 3:
        return choose().level
    level = ARCH_LEVELS[parts[1]]
    if level != "scalar" and not X86:
        pytest.skip(f"{header} is x86 code: this is {platform.machine()}")
    return level


def _include_flags() -> list[str]:
    """torch's include paths (pybind11 among them) and Python's, as torch.utils.cpp_extension gives the build."""
    from torch.utils import cpp_extension

    paths = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(build.CSRC)]
    return [f"-I{path}" for path in paths]


def test_every_arch_folder_names_its_variant() -> None:
    folders = {path.name for path in (build.CSRC / "arch").iterdir() if path.is_dir()}
    assert folders == set(ARCH_LEVELS), "a new arch/ folder needs its variant in ARCH_LEVELS"


@pytest.mark.parametrize("header", HEADERS)
def test_the_header_compiles_alone(header: str) -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
    level = _level(header)
    command = [compiler, "-fsyntax-only", "-std=c++20", *build.cflags(level), *_include_flags()]
    done = subprocess.run([*command, str(build.CSRC / header)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{header} ({level} flags) does not compile alone:\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("level", ["avx512vnni"])
def test_a_variant_that_shares_another_ones_headers_compiles(level: str) -> None:
    """The avx512vnni variant (Cascade Lake, Ice Lake) takes arch/avx512bf16/'s zmm integer tiles without its BF16
    flags: the whole translation unit is compiled with its flags on every machine (unoptimized: GCC reports an
    intrinsic the flags lack only when it inlines it, which a syntax check never does), so a BF16 instruction
    slipping into those tiles fails here, not only where a CPU picks that variant."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
    if not X86:
        pytest.skip(f"{level} is x86 code: this is {platform.machine()}")
    command = [compiler, "-c", "-o", os.devnull, "-std=c++20", "-fPIC", *build.cflags(level), "-O0", *_include_flags()]
    done = subprocess.run([*command, str(build.CSRC / "kernels.cpp")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"kernels.cpp ({level} flags) does not compile:\n{done.stderr[-4000:]}"


def test_the_build_key_covers_headers_in_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit to a header in a subfolder of csrc/ is a new build and a new packed-weight layout, as an edit to
    kernels.cpp is."""
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    before, layout = build.build_key("scalar"), build.layout_key("scalar")
    header = copy / "arch" / "generic" / "simd.h"
    header.write_text(header.read_text() + "\n")
    assert build.build_key("scalar") != before
    assert build.layout_key("scalar") != layout  # the packed weights' cache too

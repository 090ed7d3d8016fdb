"""Compile the C++ kernels for one ISA variant with torch.utils.cpp_extension, once, and cache the result.

The cache key holds the torch version, the variant and a hash of the sources, their folder and the flags, so a
build for AVX-512 is never loaded on an AVX2 machine, an edited source is rebuilt, and two installs never rebuild
each other's. Builds go to `$TOKENMILL_CACHE_DIR` (default `~/.cache/tokenmill`)/kernels/<key>; the first build of
a variant takes about a minute on two cores. A later load imports the built module itself: torch's
`cpp_extension.load` would first import setuptools and run ninja to find nothing to do (0.4-0.6 s of every start).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenmill import reaper
from tokenmill.kernels.isa import COMPILE_FLAGS, LANES

# A test-only variant: the 16-lane code (AVX-512's) built with AVX2 flags, so an AVX2 machine checks its logic.
EMULATED = "avx2-16-lanes"

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("kernels.cpp",)  # one translation unit; its headers include each other from CSRC ("arch/avx2/simd.h")


def sources() -> list[Path]:
    """Every file of the kernels' source tree (kernels.cpp and the headers under csrc/ and its folders), sorted."""
    return sorted(path for path in CSRC.rglob("*") if path.is_file())


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (no compiler, no ninja, ...)."""


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill") / "kernels"


def cflags(level: str) -> list[str]:
    lanes, flags = (16, COMPILE_FLAGS["avx2"]) if level == EMULATED else (LANES[level], COMPILE_FLAGS[level])
    return ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp", f"-DTM_W={lanes}", *flags]


def build_key(level: str) -> str:
    """The build folder's name: the sources, the flags and the sources' folder too, because torch writes their
    paths into the folder's build.ninja, so two installs of the same sources (two venvs, a clone beside a wheel)
    sharing one folder recompiled each time the other had loaded."""
    return _keys(level)[0]


def layout_key(level: str) -> str:
    """What fixes the packed weights' layout (weights/packed_cache.py): the sources and the flags, not where they
    lie, so installs of the same sources share the packed weights."""
    return _keys(level)[1]


def _keys(level: str) -> tuple[str, str]:
    import torch

    digest = hashlib.sha256()
    for path in sources():  # every source and header, in every folder: an edit to any of them is a new build
        digest.update(path.relative_to(CSRC).as_posix().encode() + path.read_bytes())
    digest.update(" ".join(cflags(level)).encode())
    prefix = f"{torch.__version__.replace('+', '_')}-{level}-"
    layout = digest.copy()
    digest.update(str(CSRC.resolve()).encode())
    return prefix + digest.hexdigest()[:12], prefix + layout.hexdigest()[:12]


def load(level: str) -> ModuleType:
    """The compiled module for `level`, building it first if the cache has none."""
    key = build_key(level)
    directory = cache_root() / key
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home, a cache path through a file: the caller falls back, in one line
        raise KernelBuildError(
            f"cannot create the kernel cache {directory} ({e.strerror}; set TOKENMILL_CACHE_DIR to a writable folder)"
        ) from e
    name = f"tokenmill_kernels_{key.replace('.', '_').replace('-', '_')}"
    if (built := _built(name, directory)) is not None:
        return built
    from torch.utils import cpp_extension

    if not any(directory.glob(f"{name}*.so")):
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise KernelBuildError(f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
        print(
            f"tokenmill: compiling the {level} CPU kernels (once; cached in {directory})", file=sys.stderr, flush=True
        )
    from tokenmill.progress import progress

    try:
        with progress(f"compiling the {level} CPU kernels"):
            return _compile(cpp_extension, name, level, directory)
    except Exception as e:  # no compiler, no ninja, a compiler that rejects the flags: the caller falls back
        first = str(e).strip().splitlines()
        raise KernelBuildError(f"{type(e).__name__}: {first[0] if first else e}") from e


def _built(name: str, directory: Path) -> ModuleType | None:
    """The module built before in `directory` (the key names its sources, flags and torch), imported as torch's
    loader imports it; None where there is none, or it does not import (a build cut short: built again)."""
    import importlib.util

    path = directory / f"{name}.so"
    if not path.is_file():
        return None
    with _build_lock(directory):  # not while another process is still writing it
        if not _whole_elf(path):  # loading a cut file would kill the process (SIGBUS), not raise
            path.unlink(missing_ok=True)
            return None
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError:
            path.unlink(missing_ok=True)
            return None
    return module


def _whole_elf(path: Path) -> bool:
    """Whether `path` reaches its section headers, which the linker writes last (a 64-bit ELF file; another
    platform's format is left to the import to judge)."""
    import struct

    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 64:
        return False
    if head[:5] != b"\x7fELF\x02":
        return True
    (table,), (entry, count) = struct.unpack_from("<Q", head, 0x28), struct.unpack_from("<HH", head, 0x3A)
    return bool(table + entry * count <= path.stat().st_size)


def _compile(cpp_extension: Any, name: str, level: str, directory: Path) -> ModuleType:
    reaper.before_spawn()  # the compiler's jobs
    with _build_lock(directory):
        return cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=cflags(level),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            verbose=False,
        )


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One tokenmill process at a time in `directory`, and no baton left by a build that died.

    torch's `load` takes a baton, a file named `lock` in the build directory, even when nothing needs building,
    and a process that finds one waits, without a word, until it is gone. A build killed by a signal (SIGTERM,
    SIGKILL, the OOM killer) never removes it, so every later start hung forever. An flock dies with its
    process: whoever holds ours is the only one that can be building here, so a baton it finds is stale.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's baton alone
        yield
        return
    with open(directory / "tokenmill.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another process is building this variant: wait for it
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

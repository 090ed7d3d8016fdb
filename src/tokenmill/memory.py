"""The process's allocator, told to give memory back.

glibc's malloc serves a large block from mmap only above its threshold, and raises that threshold (up to 32 MB)
each time such a block is freed. After a few prefills every activation and scratch tensor under 32 MB comes from
the heap, whose freed pages stay resident: serving 32 requests of 128 + 128 tokens on Qwen2.5-1.5B (Q6_K) left
the process at 3529 MB where llama-server held 1785. With the threshold fixed at 128 KB, blocks above it are
mapped and unmapped as they come and go: 2055 MB after the same run, at the same throughput (51.4 against 51.2
output tok/s; Xeon, 2 vCPUs). The switch is glibc's (mallopt M_MMAP_THRESHOLD); elsewhere this does nothing.

Below the threshold, freed blocks stay in their thread's arena; `trim` hands their pages back when the engine goes
idle.

Python's cyclic collector is paused while `serve` and `generate` import torch and load a model
(`collector_paused`): those make ~280k objects that live as long as the process, and the collector walked them
again and again for almost nothing (6760 garbage objects holding 12 KiB, on a Qwen2.5-0.5B-shape Q4_K_M). Once a
kept model has loaded, `freeze_heap` moves everything alive into the permanent generation, so a full collection
while serving walks only what serving made (a full pass over the loaded heap took 0.2-0.4 s on a slow 2-vCPU VM,
holding the GIL, so the engine loop too).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import sys
from collections.abc import Iterator

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD = 128 * 1024  # bytes: glibc's own starting value, kept fixed


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = _load_libc()
        _ = (libc.mallopt, libc.malloc_trim)  # glibc's; musl has neither
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def _load_libc() -> ctypes.CDLL:
    """glibc by its soname; else what find_library names (it runs ldconfig: a subprocess, at every start)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"))


@functools.cache
def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process (once); True where it took."""
    libc = _glibc()
    return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD)) if libc is not None else False


def trim() -> bool:
    """Give the pages of freed small blocks back to the system, in every thread's arena (glibc's malloc_trim): the
    engine calls it when it goes idle, so what a burst of requests left in the arenas (below the mmap threshold:
    Python objects, tokenizer and scratch buffers) is not held while nothing runs. True where it freed any."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for the block (a start's imports and load), then as it was before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_heap() -> None:
    """For a model kept for the process's life, once loaded: every object alive now leaves the collector's sight
    (gc.freeze; the few garbage cycles a load leaves stay, a few KiB), and the collector runs again for what
    serving makes. Never for a model that may unload: its cycles would then never be collected."""
    gc.freeze()
    gc.enable()


MADV_DONTNEED = 4  # Linux's madvise advice number


def release_code_pages() -> int:
    """Unmap the resident pages of the shared libraries' code and read-only data from this process, once a model
    has loaded: most of what `import torch` touched (~100 MiB of libtorch's code, run once by its initialisers)
    is never run again, yet it stays in the process's resident set. madvise(MADV_DONTNEED) on a private file
    mapping that holds no page of its own (no copy-on-write: Anonymous 0) drops only the page table entries: the
    pages stay in the page cache, and whatever the process runs again faults back in from it. Mappings with
    written pages (relocated data) are left alone. Returns the resident bytes released (0 off Linux/glibc)."""
    libc = _glibc()
    if libc is None:
        return 0
    released = 0
    for start, end, rss in _clean_library_mappings():
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            released += rss
    return released


def _clean_library_mappings() -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of every private read-only mapping of a shared library with no written page
    (psutil's reading of /proc/self/smaps; none where it cannot be read)."""
    import psutil

    try:
        maps = psutil.Process().memory_maps(grouped=False)
    except (psutil.Error, OSError, NotImplementedError):
        return []
    found = []
    for m in maps:
        library = m.path.startswith("/") and ".so" in m.path.rsplit("/", 1)[-1]
        if library and m.perms in ("r-xp", "r--p") and m.anonymous == 0 and m.private_dirty == 0:
            lo, hi = m.addr.split("-")
            found.append((int(lo, 16), int(hi, 16), m.rss))
    return found


def machine_bytes() -> int | None:
    """The memory this process may use: the machine's, or its cgroup's limit where lower (a container's); None where
    neither can be read."""
    import os

    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such sysconf name on this platform
        return None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(limit) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
        break
    return int(total)

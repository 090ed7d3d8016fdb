"""memory.release_code_pages: the libraries' code pages leave the resident set, and everything still runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, psutil, torch
from tokenmill.memory import release_code_pages

torch.manual_seed(0)
a, b = torch.randn(64, 96), torch.randn(96, 32)
before_product = a @ b
rss = psutil.Process().memory_info().rss
released = release_code_pages()
after = psutil.Process().memory_info().rss
again = a @ b  # libtorch's code (and its relocated data, left alone) serves the same call again
out = {"released": released, "drop": rss - after, "same": bool(torch.equal(again, before_product)),
       "softmax": float(torch.softmax(torch.tensor([1.0, 2.0]), 0)[1])}
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on /proc/self/smaps's mappings is Linux's")
def test_libraries_code_leaves_the_resident_set_and_still_runs() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    # torch's import alone leaves tens of MiB of libtorch's code resident (~100 MiB on x86 CPU wheels)
    assert out["released"] > 20 * 2**20
    assert out["drop"] > 10 * 2**20, out
    assert out["same"]
    assert out["softmax"] == pytest.approx(0.7310586, abs=1e-6)


def test_only_unwritten_private_library_mappings_are_chosen() -> None:
    from tokenmill.memory import _clean_library_mappings

    chosen = {(start, end) for start, end, _ in _clean_library_mappings()}
    if not sys.platform.startswith("linux"):
        assert chosen == set()
        return
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f]
    perms = {
        (int(m[0].split("-")[0], 16), int(m[0].split("-")[1], 16)): (m[1], m[5] if len(m) > 5 else "") for m in maps
    }
    assert chosen, "a Python process maps libpython or libc"
    for span in chosen:
        perm, path = perms[span]
        assert perm in ("r-xp", "r--p") and ".so" in path, (perm, path)
    # a library's written pages (its relocated data: rw-p) are never chosen
    written = {span for span, (perm, path) in perms.items() if perm.startswith("rw") and ".so" in path}
    assert written and not (written & chosen)

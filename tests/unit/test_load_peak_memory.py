"""Loading a safetensors folder takes at most the file's pages plus one packed copy of the weights (issue 56): each
linear is packed as soon as its weight is complete (weights/loader.py), from the file's mapped pages or from the one
fused weight being gathered, and the packed weights move into their huge-page region one by one, each old buffer
freed as its copy is made (models/linear.py: place_weights). A GGUF's first load takes one packed copy and the
pages of the tensor in hand: each tensor's pages are let go once it is packed (GGUFFile.release), and the packed
weights move into the new packed-cache file one by one (PackedCache.place).

Measured in a fresh Python, on a second load of the same folder (the first one pays for imports, the tokenizer and
the kernels' module, which are not weights): the kernel's own peak of the resident set (VmHWM, reset just before
the load through /proc/self/clear_refs, so no sample can miss a spike), and the peak of its anonymous part
(RssAnon, sampled every half millisecond: a sample can miss a spike, never invent one). Memory, not time: nothing
here depends on the CPU's speed.

The margin is one weight in flight: the largest linear weight gathered dense (a fused gate_up), plus the temporaries
of quantizing one chunk of it (formats.CHUNK_BYTES of float32 rows, set to 4 MB here so that one extra copy of the
weights stands out; a K-quant's reach ~8x that), plus 8 MB for Python's and torch's own bookkeeping. The K-quants
load through the same streaming path; they are left out for time (their quantizer takes minutes on these weights),
and test_packing_in_small_chunks_gives_the_same_bytes covers their chunking. Before the loader streamed, the same
loads took one to three packed copies more: every fused weight dense at once, packing's 4096-row chunks, and the
region filled beside the old buffers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# hidden 1024, MLP 2816, 6 layers: 130 MB of bf16, its largest linear weight (gate_up) 11.5 MB
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
             num_key_value_heads=2)  # fmt: skip
LARGEST_WEIGHT = 2 * 2816 * 1024 * 2  # bytes of gate_up [2 x 2816, 1024] in bf16
CHUNK_BYTES = 4 << 20  # formats.CHUNK_BYTES in the loading process
MARGIN = LARGEST_WEIGHT + 10 * CHUNK_BYTES + (8 << 20)

_LOAD = """
import gc, json, sys, threading, time
from pathlib import Path
from tokenmill import kernels
from tokenmill.assembly.model import load
from tokenmill.kernels import formats
from tokenmill.config import EngineConfig
from tokenmill.memory import trim
from tokenmill.models.linear import weight_bytes
from tokenmill.weights import packed_cache
folder, quantization, fresh = sys.argv[1], sys.argv[2], sys.argv[3]
formats.CHUNK_BYTES = 4 << 20
cached = EngineConfig(model=folder, quantization=quantization, weight_cache=bool(fresh))
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024
kernels.active()
if fresh:  # the warm-up's packed-cache entry, where no other test reads it
    packed_cache.cache_root = lambda: Path(fresh + "-warm-up")
first = load(cached)
del first
gc.collect()
trim()
peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], status("RssAnon"))
        time.sleep(0.0005)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS now
rss, anon = status("VmRSS"), status("RssAnon")
sampler = threading.Thread(target=sample)
sampler.start()
if fresh:  # the first start of this file: packed and written into an empty cache folder
    packed_cache.cache_root = lambda: Path(fresh)
loaded = load(cached)
done.set()
sampler.join()
files = [Path(folder)] if Path(folder).is_file() else list(Path(folder).glob("*.safetensors"))
entries = list(Path(fresh).glob("*.bin")) if fresh else []
print(json.dumps({"file": sum(p.stat().st_size for p in files), "cached": len(entries),
                  "packed": weight_bytes(loaded.model), "peak": status("VmHWM") - rss, "anon": peak[0] - anon,
                  "kernels": loaded.kernels}))
"""


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", dtype="bfloat16", **SHAPE)


def _measure(source: Path, quantization: str, fresh: str = "") -> dict[str, Any]:
    """The load's figures (the script above), in bytes; skipped where the linears stay plain."""
    if not sys.platform.startswith("linux") or not Path("/proc/self/clear_refs").exists():
        pytest.skip("not Linux: the peak resident set is read from /proc/self/status")
    done = subprocess.run([sys.executable, "-c", _LOAD, str(source), quantization, fresh], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    m: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not set(m["kernels"]) - {"plain", "packed"}:
        pytest.skip(f"the linears were not packed into kernel formats here ({m['kernels']}): no compiled kernels")
    return m


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_a_safetensors_load_takes_the_files_pages_and_one_packed_copy(folder: Path, quantization: str) -> None:
    m = _measure(folder, quantization)  # the packed-weight cache off: packed as it loads, each time
    mb = {k: round(v / 2**20, 1) for k, v in m.items() if isinstance(v, int)}
    assert m["peak"] <= m["file"] + m["packed"] + MARGIN, f"{mb}, margin {MARGIN / 2**20:.1f} MB"
    assert m["anon"] <= m["packed"] + MARGIN, f"{mb}, margin {MARGIN / 2**20:.1f} MB"


@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
def test_a_ggufs_first_load_takes_one_packed_copy(folder: Path, tmp_path: Path, dtype: str) -> None:
    """The file's pages go as each tensor is packed, and the packed weights move into the new cache file one by
    one: before, the first load held the whole file, the packed weights, and their copy in the cache file. A bf16
    file's linears are packed from dense rows; a Q8_0 file's from its blocks (q and k held as views of the map
    until v comes, the embedding packed from its blocks)."""
    from tokenmill.bench.gguf_export import export_gguf

    gguf = export_gguf(folder, tmp_path / "model.gguf", dtype)
    m = _measure(gguf, "none", str(tmp_path / "packed"))
    mb = {k: round(v / 2**20, 1) for k, v in m.items() if isinstance(v, int)}
    assert m["cached"] == 1, f"no packed-cache entry was written: {mb}"
    assert m["peak"] <= m["packed"] + MARGIN, f"{mb}, margin {MARGIN / 2**20:.1f} MB"
    assert m["anon"] <= m["packed"] + MARGIN, f"{mb}, margin {MARGIN / 2**20:.1f} MB"


@pytest.mark.parametrize("fmt", ["bf16", "f32", "q8_0", "q4_0", "q4_k", "q6_k"])
def test_packing_in_small_chunks_gives_the_same_bytes(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks that bound packing's temporaries (formats.CHUNK_BYTES) are whole panels, each written where it
    lies: 70 rows (a partial last panel) in chunks of 16 rows pack exactly as in one chunk."""
    import torch

    from tokenmill.kernels import formats

    w = torch.randn(70, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [N, K]
    whole = formats.pack(w, fmt)
    monkeypatch.setattr(formats, "CHUNK_BYTES", 16 * 4 * 512)  # one panel of float32 rows a chunk
    chunked = formats.pack(w, fmt)
    assert chunked.format == whole.format and torch.equal(chunked.data, whole.data)

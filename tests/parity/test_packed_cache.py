"""A GGUF's or a safetensors folder's packed weights kept between starts (weights/packed_cache.py): the first load
moves them into a cache file and serves from its pages, a later load maps that file instead of repacking, and a
damaged, stale or unwritable cache never changes what the model computes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parity.test_gguf_kquants import _wide_llama
from tests.parity.test_gguf_loading import PROMPTS, _greedy, _logits
from tokenmill import LLM
from tokenmill.bench.gguf_export import export_gguf
from tokenmill.models.linear import KernelLinear, SegmentedLinear
from tokenmill.models.packed_embedding import PackedEmbedding
from tokenmill.weights import packed_cache
from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps to see where weights lie")
MIXED = {"blk.0.attn_v.weight": "q6_k", "blk.1.ffn_down.weight": "q5_0"}  # a SegmentedLinear, and a second type


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache folder, private to the test (the kernels' own cache, under the same variable, stays put)."""
    folder = tmp_path / "packed"
    monkeypatch.setattr(packed_cache, "cache_root", lambda: folder)
    return folder


@pytest.fixture(scope="module")
def gguf_file(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_K with Q6_K and Q5_0 mixed in, its token embedding in blocks too (a PackedEmbedding)."""
    out = tmp_path_factory.mktemp("packed") / "q4_k.gguf"
    return export_gguf(_wide_llama(make_checkpoint), out, "q4_k", overrides=MIXED)


def _weights(llm: LLM) -> dict[str, torch.Tensor]:
    """Module name -> its packed bytes, for every kernel linear and packed embedding."""
    mods = llm.loaded.model.named_modules()
    return {n: m.data for n, m in mods if isinstance(m, (KernelLinear, PackedEmbedding))}


def _mapped_from(ptr: int) -> str:
    """The file whose mapping holds address `ptr` ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= ptr < high:
            return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{ptr:#x} is not mapped")


def _only_entry(root: Path) -> Path:
    entries = list(root.glob("*.bin"))
    assert len(entries) == 1, entries
    return entries[0]


def test_the_second_load_maps_what_the_first_packed(gguf_file: Path, root: Path) -> None:
    first = LLM(str(gguf_file), dtype="float32")
    entry = _only_entry(root)
    written = entry.stat().st_mtime_ns
    assert isinstance(first.loaded.model.model.layers[0].self_attn.qkv_proj, SegmentedLinear)
    assert any(isinstance(m, PackedEmbedding) for m in first.loaded.model.modules())
    for name, data in _weights(first).items():  # served from the new file's pages, not from a copy beside them
        assert _mapped_from(data.data_ptr()) == str(entry), name
    second = LLM(str(gguf_file), dtype="float32")
    assert entry.stat().st_mtime_ns == written and _only_entry(root) == entry  # read, not written again
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys()
    for name in a:
        assert _mapped_from(b[name].data_ptr()) == str(entry), name
        assert torch.equal(a[name], b[name]), name
    plain = LLM(str(gguf_file), dtype="float32", weight_cache=False)  # packed from the file, in anonymous memory
    assert all(_mapped_from(d.data_ptr()) != str(entry) for d in _weights(plain).values())
    ids = plain.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(second, ids), _logits(plain, ids))
    assert _greedy(first, PROMPTS) == _greedy(second, PROMPTS) == _greedy(plain, PROMPTS)


def test_a_first_load_leaves_no_weight_page_of_the_gguf_resident(gguf_file: Path, root: Path) -> None:
    """While something still holds the file's map (a server's engine keeps its metadata for a deferred tokenizer),
    none of its weights' pages stay in the resident set after a first load: a shard held for its fused partners
    (q and k until v, gate until up) is read when they come, after its own pages were let go, and let go again.
    Before, a Qwen2.5-0.5B-shape Q5_K_M file's q, k and gate kept 99 MB resident beside the packed copy."""
    from tokenmill.assembly import load
    from tokenmill.config import EngineConfig
    from tokenmill.tokenizer import Tokenizer

    held: list[Any] = []

    def keep(source: Path, model_type: str | None, meta: Any) -> Tokenizer:
        held.append(meta)  # (GGUFCheckpoint.metadata, bound: it holds the reader, so the map stays)
        return Tokenizer(source, model_type, meta)

    load(EngineConfig(model=str(gguf_file), dtype="float32"), make_tokenizer=keep)
    assert _only_entry(root).exists()  # a first load: packed and written
    reader = held[0].__self__.reader
    start, size = reader._span
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // page * 8)
        entries = f.read(-(-size // page) * 8)
    resident = sum(entries[i * 8 + 7] >> 7 for i in range(len(entries) // 8))  # bit 63: the page is present
    edges = 2 * len(reader.tensors) + -(-reader.data_offset // page)  # each tensor's partial pages, and the header
    assert resident <= edges, f"{resident} pages of {gguf_file.name} resident, at most {edges} expected"


def test_a_float_ggufs_dense_weights_and_tied_head_come_from_the_cache_too(
    make_checkpoint: Callable[..., Path], tmp_path: Path, root: Path
) -> None:
    """A BF16 GGUF: its linears are packed at the first load (the tied LM head too, and the embedding looks its rows
    up in the head's panels); the second maps every one of them from the entry, writes nothing, and computes the
    same."""
    ckpt = make_checkpoint("llama", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    path = export_gguf(ckpt, tmp_path / "bf16.gguf", "bf16")
    first = LLM(str(path), dtype="bfloat16")
    entry = _only_entry(root)
    written = entry.stat().st_mtime_ns
    second = LLM(str(path), dtype="bfloat16")
    assert entry.stat().st_mtime_ns == written and _only_entry(root) == entry  # read, not written again
    weights = _weights(second)
    assert "lm_head" in weights and {m.format for m in second.loaded.model.modules() if isinstance(m, KernelLinear)} \
        == {"bf16"}  # fmt: skip
    assert second.loaded.model.embeddings().data is second.loaded.model.lm_head.data  # one copy of the table
    for name, data in weights.items():
        assert _mapped_from(data.data_ptr()) == str(entry), name
        assert torch.equal(data, _weights(first)[name]), name
    plain = LLM(str(path), dtype="bfloat16", weight_cache=False)
    ids = plain.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(second, ids), _logits(plain, ids))
    assert _greedy(second, PROMPTS) == _greedy(plain, PROMPTS)


def test_a_float_ggufs_tensors_are_read_in_place_and_none_stays_in_its_map(
    make_checkpoint: Callable[..., Path], tmp_path: Path, root: Path
) -> None:
    """A BF16 GGUF's dense tensors come as views of the file's map, not copies (so a load that maps its linears from
    the packed cache never reads their bytes: 0.4 s of a 0.5B file's start went to copying them); whatever the model
    keeps of them is copied out of that read-only map: at the first load and the second, and without the kernels,
    where the linears stay torch parameters (down_proj, [512, 2304], is above the size the loader copies anyway).
    Each computes as a load without the cache. (qwen2: a `llama` file's q and k rows are permuted back, into
    copies.)"""
    ckpt = make_checkpoint("qwen2", hidden_size=512, intermediate_size=2304)
    path = export_gguf(ckpt, tmp_path / "bf16.gguf", "bf16")
    checkpoint = GGUFCheckpoint(path)
    dense = [v for _, v, _ in checkpoint.iter_tensors(checkpoint.hf_config()) if isinstance(v, torch.Tensor)]
    assert len(dense) > 10 and all(checkpoint.reader.maps(v.data_ptr()) for v in dense)
    plain = LLM(str(path), dtype="bfloat16", weight_cache=False)
    folder = LLM(str(ckpt), dtype="bfloat16", cpu_kernels=False)  # the same bf16 weights, from the folder
    ids = plain.loaded.tokenizer.encode(PROMPTS[0])
    for load, kwargs, want in (("first", {}, plain), ("second", {}, plain), ("no kernels", {"cpu_kernels": False},
                                                                              folder)):  # fmt: skip
        llm = LLM(str(path), dtype="bfloat16", **kwargs)
        kept = {n: p for n, p in llm.loaded.model.named_parameters() if p.device.type == "cpu"}
        assert "model.layers.0.mlp.down_proj.weight" in kept or load != "no kernels", sorted(kept)
        assert not [n for n, p in kept.items() if _mapped_from(p.data_ptr()) == str(path)], load
        assert torch.equal(_logits(llm, ids), _logits(want, ids)), load
    assert _only_entry(root).exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong shape"])
def test_a_damaged_entry_is_packed_again(gguf_file: Path, root: Path, damage: str) -> None:
    want = _greedy(LLM(str(gguf_file), dtype="float32", weight_cache=False), PROMPTS[:1])
    LLM(str(gguf_file), dtype="float32")
    entry = _only_entry(root)
    size = entry.stat().st_size
    raw = entry.read_bytes()
    if damage == "truncated":  # a header that points past the end
        damaged = raw[: size // 2]
    elif damage == "garbage":
        damaged = b"not a cache" + raw[11:]
    else:  # a weight that claims another shape: that one is packed anew
        damaged = raw.replace(b'"q4_k", 256, 256', b'"q4_k", 256, 512', 1)
    assert damaged != raw
    entry.write_bytes(damaged)
    llm = LLM(str(gguf_file), dtype="float32")
    assert _greedy(llm, PROMPTS[:1]) == want
    assert _only_entry(root).stat().st_size == size  # written whole again
    assert all(_mapped_from(d.data_ptr()) == str(entry) for d in _weights(llm).values())


def test_a_rewritten_file_is_never_served_stale(make_checkpoint: Callable[..., Path], root: Path,
                                               tmp_path: Path) -> None:  # fmt: skip
    """The same path, rewritten with other weights at the same size: a new entry, and the old one removed."""
    path = tmp_path / "model.gguf"
    export_gguf(_wide_llama(make_checkpoint), path, "q4_k")
    LLM(str(path), dtype="float32")
    old = _only_entry(root)
    other = make_checkpoint("llama", seed=1, hidden_size=256, intermediate_size=512, initializer_range=0.1)
    export_gguf(other, path, "q4_k")
    llm = LLM(str(path), dtype="float32")
    assert _only_entry(root) != old
    want = LLM(str(path), dtype="float32", weight_cache=False)
    ids = want.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(llm, ids), _logits(want, ids))


def test_entries_of_deleted_files_go(make_checkpoint: Callable[..., Path], root: Path, tmp_path: Path) -> None:
    ckpt = _wide_llama(make_checkpoint)
    gone = export_gguf(ckpt, tmp_path / "gone.gguf", "q4_k")
    LLM(str(gone), dtype="float32")
    gone.unlink()
    kept = export_gguf(ckpt, tmp_path / "kept.gguf", "q4_k")
    LLM(str(kept), dtype="float32")
    assert _only_entry(root).name.startswith(packed_cache.cache_path(kept, "", b"").name.partition("-")[0])


def test_an_unwritable_cache_folder_changes_nothing(gguf_file: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(packed_cache, "cache_root", lambda: blocker / "packed")  # mkdir fails: not a directory
    llm = LLM(str(gguf_file), dtype="float32")
    assert all(_mapped_from(d.data_ptr()) in ("", "[heap]") for d in _weights(llm).values())  # placed as before
    want = LLM(str(gguf_file), dtype="float32", weight_cache=False)
    assert _greedy(llm, PROMPTS[:1]) == _greedy(want, PROMPTS[:1])


@pytest.mark.parametrize(("dtype", "quantization"), [("bfloat16", "none"), ("float32", "int8")])
def test_a_safetensors_folders_packed_weights_come_from_the_cache(
    make_checkpoint: Callable[..., Path], root: Path, dtype: str, quantization: str
) -> None:
    """A folder's linears, packed (or quantized) as they load at the first start, are mapped from the entry at the
    second, which writes nothing, reads none of their values from the folder (the fused q|k|v and gate|up are never
    gathered), and computes the same; once loaded, nothing holds the folder's file."""
    folder = make_checkpoint("llama", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    weights_file = str(folder / "model.safetensors")
    first = LLM(str(folder), dtype=dtype, quantization=quantization)
    entry = _only_entry(root)
    written = entry.stat().st_mtime_ns
    second = LLM(str(folder), dtype=dtype, quantization=quantization)
    assert entry.stat().st_mtime_ns == written and _only_entry(root) == entry  # read, not written again
    weights = _weights(second)
    assert "lm_head" in weights and "model.layers.0.self_attn.qkv_proj" in weights
    for name, data in weights.items():
        assert _mapped_from(data.data_ptr()) == str(entry), name
        assert torch.equal(data, _weights(first)[name]), name
    assert weights_file not in Path("/proc/self/maps").read_text()  # no norm or bias still viewing its map
    plain = LLM(str(folder), dtype=dtype, quantization=quantization, weight_cache=False)
    ids = plain.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(second, ids), _logits(plain, ids))
    assert _greedy(second, PROMPTS) == _greedy(plain, PROMPTS)


def test_a_rewritten_folder_is_never_served_stale(make_checkpoint: Callable[..., Path], root: Path,
                                                 tmp_path: Path) -> None:  # fmt: skip
    """The same folder, its weights file rewritten with other weights of the same size: a new entry."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(make_checkpoint("llama", hidden_size=256, intermediate_size=512), folder)
    LLM(str(folder), dtype="bfloat16")
    old = _only_entry(root)
    other = make_checkpoint("llama", seed=1, hidden_size=256, intermediate_size=512)
    shutil.copyfile(other / "model.safetensors", folder / "model.safetensors")
    llm = LLM(str(folder), dtype="bfloat16")
    assert _only_entry(root) != old
    want = LLM(str(folder), dtype="bfloat16", weight_cache=False)
    ids = want.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(llm, ids), _logits(want, ids))

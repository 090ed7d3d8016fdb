"""Our GGUF parser (`tokenmill.weights.gguf_reader`) reads what the `gguf` package's reader reads: every metadata
value of every type, and every tensor's name, type, shape and bytes, on files written by `gguf.GGUFWriter`. A file
cut anywhere before its last tensor's end, or not GGUF at all, is a `GGUFError`, and a `ModelLoadError` through
`GGUFCheckpoint`, never a raw struct.error or IndexError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint
from tokenmill.weights.gguf_reader import GGUFError, GGUFFile

V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
SCALARS: list[tuple[str, Any, gguf.GGUFValueType]] = [
    ("u8", 255, V.UINT8), ("i8", -128, V.INT8), ("u16", 65535, V.UINT16), ("i16", -32768, V.INT16),
    ("u32", 2**32 - 1, V.UINT32), ("i32", -(2**31), V.INT32), ("u64", 2**64 - 1, V.UINT64),
    ("i64", -(2**63), V.INT64), ("f32", 0.1, V.FLOAT32), ("f64", -1e-300, V.FLOAT64), ("yes", True, V.BOOL),
    ("no", False, V.BOOL), ("text", "Ünïcödé 日本語 🙂", V.STRING), ("empty", "", V.STRING),
]  # fmt: skip
ARRAYS: list[tuple[str, list[Any], gguf.GGUFValueType]] = [
    ("a_u8", [0, 1, 255], V.UINT8), ("a_i8", [-1, 2], V.INT8), ("a_u16", [7, 65535], V.UINT16),
    ("a_i16", [-3, 4], V.INT16), ("a_u32", [2**32 - 1, 0], V.UINT32), ("a_i32", [-(2**31), 5, 6], V.INT32),
    ("a_u64", [2**64 - 1], V.UINT64), ("a_i64", [-(2**63), 1], V.INT64), ("a_f32", [0.5, -0.1, 3e38], V.FLOAT32),
    ("a_f64", [1e-300, -2.5], V.FLOAT64), ("a_bool", [True, False, True], V.BOOL),
    ("a_str", ["", "a", "Ünïcödé", "🙂 x"], V.STRING),  # (the writer refuses empty arrays)
    ("vocab", [f"tok{i}" * (i % 7) for i in range(5000)], V.STRING),
]  # fmt: skip


def _tensors(rng: np.random.Generator) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]]:
    """(name, array, raw type) for each ggml type tokenmill loads; K-quants (which the gguf package cannot
    quantize) get random bytes of the right size."""
    w = rng.standard_normal((4, 256)).astype(np.float32)  # [rows, row]
    out: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]] = [
        ("token_embd.weight", rng.standard_normal((6, 32)).astype(np.float32), None),
        ("norm.weight", rng.standard_normal(32).astype(np.float32), None),
        ("f16.weight", w.astype(np.float16), None),
        ("cube.weight", rng.standard_normal((2, 3, 4)).astype(np.float32), None),
    ]
    for kind in (Q.BF16, Q.Q8_0, Q.Q4_0):
        out.append((f"{kind.name.lower()}.weight", gguf.quants.quantize(w, kind), kind))
    for kind in (Q.Q4_K, Q.Q6_K):
        block, size = gguf.GGML_QUANT_SIZES[kind]
        out.append((f"{kind.name.lower()}.weight", rng.integers(0, 256, (4, 256 // block * size), np.uint8), kind))
    return out


def _write(path: Path, alignment: int | None = None, small: bool = False) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS[:3] if small else SCALARS:
        writer.add_key_value(f"test.{key}", value, vtype)
    for key, values, vtype in ARRAYS[5:6] + ARRAYS[-2:-1] if small else ARRAYS:  # small: a_i32, a_str
        writer.add_key_value(f"test.{key}", values, V.ARRAY, sub_type=vtype)
    for name, array, raw in _tensors(np.random.default_rng(0))[: 2 if small else None]:
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("gguf") / "all.gguf")


def _assert_same_as_gguf(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.version == theirs.fields["GGUF.version"].contents()
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        want = theirs.fields[key]
        assert field.type == want.types[0], key
        assert field.contents() == want.contents(), key
        assert _types(field.contents()) == _types(want.contents()), key
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for t, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert (t.tensor_type, list(t.shape), t.n_elements, t.n_bytes) == (
            want.tensor_type, want.shape.tolist(), want.n_elements, want.n_bytes), t.name  # fmt: skip
        assert t.data_offset == want.data_offset, t.name
        assert (t.data.dtype, t.data.shape) == (want.data.dtype, want.data.shape), t.name
        assert t.data.tobytes() == want.data.tobytes(), t.name
        assert not t.data.flags.writeable and not t.data.flags.owndata, f"{t.name}: not a view of the map"
    return ours


def _types(value: Any) -> list[type]:
    return [type(value)] + ([type(x) for x in value] if isinstance(value, list) else [])


def test_every_value_type_and_tensor_type_reads_as_the_gguf_package_reads_it(written: Path) -> None:
    ours = _assert_same_as_gguf(written)
    assert ours.fields["test.u64"].contents() == 2**64 - 1
    assert ours.fields["test.text"].contents() == "Ünïcödé 日本語 🙂"
    assert ours.fields["test.a_f32"].contents() == [float(np.float32(x)) for x in (0.5, -0.1, 3e38)]
    assert ours.fields["test.vocab"].contents()[4999] == "tok4999"
    assert {t.tensor_type for t in ours.tensors} >= {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K}


def test_a_custom_alignment_moves_the_data_section(tmp_path: Path) -> None:
    ours = _assert_same_as_gguf(_write(tmp_path / "a.gguf", alignment=256))
    assert ours.alignment == 256 and ours.data_offset % 256 == 0
    assert all(t.data_offset % 256 == 0 for t in ours.tensors)


def test_arrays_are_views_and_strings_are_decoded_only_when_asked(written: Path, tmp_path: Path) -> None:
    f = GGUFFile(written)
    ids = f.fields["test.a_i32"]
    assert isinstance(ids.value, np.ndarray) and not ids.value.flags.owndata and ids.count == 3
    assert f.fields["test.vocab"].value is None and f.fields["test.vocab"].count == 5000
    # a string array's bad UTF-8 opens fine, and is an error only once read
    good = "Ünïcödé".encode()
    item = len(good).to_bytes(8, "little") + good  # item 2 of test.a_str; test.text's length differs
    data = written.read_bytes()
    assert data.count(item) == 1
    (tmp_path / "bad.gguf").write_bytes(data.replace(item, item[:8] + b"\xff" * len(good)))
    f = GGUFFile(tmp_path / "bad.gguf")
    assert f.fields["test.text"].contents() == "Ünïcödé 日本語 🙂"
    with pytest.raises(GGUFError, match=r"item 2 of 'test.a_str' is not UTF-8"):
        f.fields["test.a_str"].contents()


def test_a_file_cut_anywhere_before_its_data_ends_is_a_gguf_error(tmp_path: Path) -> None:
    data = _write(tmp_path / "small.gguf", small=True).read_bytes()
    end = max(t.data_offset + t.n_bytes for t in GGUFFile(tmp_path / "small.gguf").tensors)
    cut = tmp_path / "cut.gguf"
    for n in range(end):
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFError):
            GGUFFile(cut)
    cut.write_bytes(data[:end])  # the padding after the last tensor is not needed
    assert GGUFFile(cut).tensors[-1].data.tobytes() == GGUFFile(tmp_path / "small.gguf").tensors[-1].data.tobytes()


def test_truncated_or_foreign_files_are_one_clear_model_load_error(written: Path, tmp_path: Path) -> None:
    data, theirs = written.read_bytes(), gguf.GGUFReader(written)
    kv_start, infos_start = theirs.fields["test.u8"].offset, theirs.tensors[0].field.offset
    vocab = theirs.fields["test.vocab"].offset
    first = theirs.tensors[0]
    cuts = {  # where the file ends -> what the message says ran out
        3: "too short for a GGUF header", 10: "the header runs past the end of the file",
        kv_start + 5: "key #1's name runs past", vocab + 20_000: "the value of 'test.vocab' runs past",
        infos_start + 7: "tensor #0's name runs past",
        first.data_offset + first.n_bytes // 2: rf"tensor 'token_embd.weight' holds {first.n_bytes // 2} of its",
        len(data) - 100: r"tensor 'q6_k.weight' holds \d+ of its 840 bytes",
    }  # fmt: skip
    one_line = r"cut.gguf is not a GGUF file, or is truncated or corrupt \(.*"
    for n, says in cuts.items():
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match=one_line + says):
            GGUFCheckpoint(tmp_path / "cut.gguf")
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match=r"truncated or corrupt \(it starts with b'PK\\x03\\x04', not b'GGUF'\)"):
        GGUFCheckpoint(tmp_path / "zip.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"too short for a GGUF header"):
        GGUFCheckpoint(tmp_path / "empty.gguf")


def test_a_big_endian_file_or_a_bad_alignment_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "be.gguf", "llama", endianess=gguf.GGUFEndian.BIG)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="big-endian"):
        GGUFFile(tmp_path / "be.gguf")
    data = _write(tmp_path / "a.gguf", alignment=64, small=True).read_bytes()
    key = b"general.alignment" + (4).to_bytes(4, "little")  # the key, then UINT32's type id
    (tmp_path / "a.gguf").write_bytes(data.replace(key + (64).to_bytes(4, "little"), key + (48).to_bytes(4, "little")))
    with pytest.raises(GGUFError, match="general.alignment is 48, not a power of two"):
        GGUFFile(tmp_path / "a.gguf")


@pytest.mark.parametrize(("field", "value"), [("type", Q.Q4_0), ("type", Q.F32), ("offset", 32), ("offset", 0)])
def test_a_tensor_table_whose_offsets_or_types_were_changed_is_refused(written: Path, tmp_path: Path, field: str,
                                                                       value: int) -> None:  # fmt: skip
    """A tensor's data starts where the one before it ends, padded (every writer's layout, and llama.cpp's rule): a
    type changed (its bytes shrink or grow over the next tensor's) or an offset moved (a gap, or the first tensor's
    bytes read twice) is a corrupt table, not garbage weights."""
    data = bytearray(written.read_bytes())
    name = b"q8_0.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4 + 2 * 8  # past the name and 2 dims
    assert int.from_bytes(data[at : at + 4], "little") == Q.Q8_0
    if field == "type":
        data[at : at + 4] = int(value).to_bytes(4, "little")
    else:
        offset = int.from_bytes(data[at + 4 : at + 12], "little")
        data[at + 4 : at + 12] = (offset + value if value else 0).to_bytes(8, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor table is corrupt|holds \d+ of its"):
        GGUFFile(tmp_path / "bad.gguf")

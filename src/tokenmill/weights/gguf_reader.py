"""A read-only GGUF (v2 and v3) parser: the header, every metadata key/value, the tensor table, and each tensor's
bytes as a zero-copy numpy view of one read-only memory map of the file.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array, millions of them
for a 151k-token vocabulary and its merges (8.6 s to open a Qwen2 file), and the checkpoint reads none of those
strings (the tokenizer is built by transformers, and cached). The `gguf` package still supplies the format's
constants (value types, ggml types, block sizes) and the K-quant dequantizers.

- An array of numbers is one `np.frombuffer` view of the map: no Python work per element.
- An array of strings is walked once over its lengths (a tight `struct.unpack_from` loop) and decoded only when
  `contents()` asks. The walk is needed anyway: strings vary in length, so the next key's offset is known only
  after the last one. Remembering where the array starts costs nothing on top of that and keeps the values
  readable (tests compare them with the gguf package's), while decoding eagerly would build 300k Python strings
  that nobody reads.
- Every read is checked against the file's size, so a truncated or foreign file raises `GGUFError` saying what
  ran past the end, never a struct.error or IndexError.
- Little-endian files only: big-endian GGUFs (made for s390x) would need their tensors byte-swapped.

The layout (all integers little-endian):
  header       "GGUF" | u32 version | u64 tensor count | u64 KV count
  KV           string key | u32 value type | value
               string = u64 length | UTF-8 bytes; array = u32 item type | u64 count | items (not arrays)
  tensor info  string name | u32 n_dims | u64 dims[n_dims] (ggml order: row length first) | u32 ggml type
               | u64 offset (from the data section's start)
  data         from the end of the tensor infos, padded to `general.alignment` (32 unless the file says)
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, KV count
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_ARRAY = struct.Struct("<IQ")  # item type, count
_TYPE_OFFSET = struct.Struct("<IQ")  # a tensor's ggml type and data offset
_V = GGUFValueType
# scalar value types: how one is unpacked, and the dtype of an array of them
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype[Any]]] = {
    vtype: (struct.Struct("<" + fmt), np.dtype("<" + dt))
    for vtype, fmt, dt in [
        (_V.UINT8, "B", "u1"), (_V.INT8, "b", "i1"), (_V.UINT16, "H", "u2"), (_V.INT16, "h", "i2"),
        (_V.UINT32, "I", "u4"), (_V.INT32, "i", "i4"), (_V.UINT64, "Q", "u8"), (_V.INT64, "q", "i8"),
        (_V.FLOAT32, "f", "f4"), (_V.FLOAT64, "d", "f8"), (_V.BOOL, "?", "b1"),
    ]
}  # fmt: skip
_G = GGMLQuantizationType
# ggml types viewed in their element dtype, as the gguf package views them; every other type is viewed as bytes
_ELEMENTS: dict[GGMLQuantizationType, np.dtype[Any]] = {
    _G.F32: np.dtype("<f4"), _G.F16: np.dtype("<f2"), _G.F64: np.dtype("<f8"), _G.I8: np.dtype("i1"),
    _G.I16: np.dtype("<i2"), _G.I32: np.dtype("<i4"), _G.I64: np.dtype("<i8"),
}  # fmt: skip


class GGUFError(ValueError):
    """Not a GGUF file we can read: another format, truncated, corrupt, or a variant we do not support."""


@dataclass(frozen=True, eq=False)
class GGUFField:
    """One metadata key/value. `value`: a scalar's or a string's Python value; an array of numbers' numpy view
    of the map; None for an array of strings, which `contents()` decodes."""

    name: str
    type: GGUFValueType
    item_type: GGUFValueType | None  # arrays: their items' type
    count: int  # arrays: their length; 1 otherwise
    value: Any
    offset: int  # the value's first byte in the file (an array's: its first item's)
    _buf: mmap.mmap = field(repr=False)

    def contents(self) -> Any:
        """The value as `gguf.GGUFReader`'s `contents()` gives it: a Python scalar, a str, or a list of them."""
        if self.type != GGUFValueType.ARRAY:
            return self.value
        if self.item_type == GGUFValueType.STRING:
            return list(_strings(self._buf, self.offset, self.count, self.name))
        return self.value.tolist()


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor's table entry and its bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order, row length first: token_embd is [hidden, vocab]
    n_elements: int
    n_bytes: int
    data_offset: int  # its first byte in the file
    # zero-copy and read-only, numpy order: [..., rows, row] in the element dtype for F32/F16/F64/I8..I64,
    # [..., rows, row bytes] uint8 for the block types and BF16 (as the gguf package shapes them)
    data: np.ndarray[Any, Any]


class GGUFFile:
    """One GGUF file, parsed and memory-mapped read-only; `fields` and `tensors` in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(MAGIC):
                raise GGUFError(f"the file is {size} bytes long, too short for a GGUF header")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the file object
        if self._buf[: len(MAGIC)] != MAGIC:
            raise GGUFError(f"it starts with {self._buf[: len(MAGIC)]!r}, not {MAGIC!r}")
        cur = _Cursor(self._buf, size)
        _, self.version, n_tensors, n_kv = cur.unpack(_HEADER, "the header")
        if self.version not in VERSIONS:
            if self.version and self.version & 0xFFFF == 0:  # a small version number read the wrong way round
                raise GGUFError("it is a big-endian GGUF file; only little-endian ones are supported")
            raise GGUFError(f"GGUF version {self.version} is not supported (only {', '.join(map(str, VERSIONS))})")
        self.fields: dict[str, GGUFField] = {}
        for i in range(n_kv):
            kv = _read_field(cur, i)
            if kv.name in self.fields:
                raise GGUFError(f"the key {kv.name!r} appears twice")
            self.fields[kv.name] = kv
        infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
        self.alignment = _alignment(self.fields)
        self.data_offset = -(-cur.off // self.alignment) * self.alignment  # the end of the infos, rounded up
        whole = np.frombuffer(self._buf, np.uint8)  # [file bytes], read-only
        self._span = (whole.ctypes.data, whole.nbytes)  # where the map lies in this process's memory
        self.tensors = [_tensor(whole, self.data_offset, *info) for info in infos]
        _check_layout(self.tensors, self.data_offset, self.alignment)
        if len({t.name for t in self.tensors}) != len(self.tensors):
            names = [t.name for t in self.tensors]
            raise GGUFError(f"the tensor {next(n for n in names if names.count(n) > 1)!r} appears twice")

    def maps(self, address: int) -> bool:
        """Whether `address` lies in this file's (read-only) map."""
        start, size = self._span
        return start <= address < start + size

    def release(self, t: GGUFTensor) -> None:
        """Let go of the pages of `t` this process has read. They stay in the page cache, and a later read of `t`
        maps them again: a first load packs each weight and moves on, and the file's pages would otherwise all
        count in its resident set beside the packed copy until the file is closed."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        start = -(-t.data_offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside `t` only
        end = (t.data_offset + t.n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if advice is not None and end > start:
            with contextlib.suppress(OSError, ValueError):  # advice only: where it is refused, the pages stay
                self._buf.madvise(advice, start, end - start)

    def sample(self, edge: int = 4096) -> bytes:
        """The header, and the first and last `edge` bytes of every tensor: a fingerprint of the contents that reads
        a few pages, not the file (weights/packed_cache.py keys its entries by it)."""
        parts = [self._buf[: self.data_offset]]
        for t in self.tensors:
            start, end = t.data_offset, t.data_offset + t.n_bytes
            parts += [self._buf[start : min(start + edge, end)], self._buf[max(end - edge, start) : end]]
        return b"".join(parts)


class _Cursor:
    """Reads the map front to back, every read checked against the file's size."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.off = buf, size, 0

    def take(self, n: int, what: str) -> int:
        """Claims the next `n` bytes for `what` and returns where they start."""
        start = self.off
        if start + n > self.size:
            raise GGUFError(f"{what} runs past the end of the file (byte {start + n} of {self.size})")
        self.off = start + n
        return start

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack_from(self.buf, self.take(st.size, what))

    def string(self, what: str) -> str:
        n = self.unpack(_U64, what)[0]
        start = self.take(n, what)
        return _decode(self.buf[start : start + n], what)


def _read_field(cur: _Cursor, i: int) -> GGUFField:
    name = cur.string(f"key #{i}'s name")
    what = f"the value of {name!r}"
    vtype = _value_type(cur.unpack(_U32, what)[0], what)
    if vtype == GGUFValueType.STRING:
        start = cur.off
        return GGUFField(name, vtype, None, 1, cur.string(what), start, cur.buf)
    if vtype != GGUFValueType.ARRAY:
        start = cur.off
        return GGUFField(name, vtype, None, 1, cur.unpack(_SCALARS[vtype][0], what)[0], start, cur.buf)
    raw_item, count = cur.unpack(_ARRAY, what)
    item = _value_type(raw_item, what)
    start = cur.off
    if item == GGUFValueType.ARRAY:
        raise GGUFError(f"{what} is an array of arrays, which GGUF readers (llama.cpp's too) do not support")
    if item == GGUFValueType.STRING:
        cur.off = _skip_strings(cur, count, what)
        return GGUFField(name, vtype, item, count, None, start, cur.buf)
    dtype = _SCALARS[item][1]
    cur.take(count * dtype.itemsize, what)
    return GGUFField(name, vtype, item, count, np.frombuffer(cur.buf, dtype, count, start), start, cur.buf)


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFError(f"{what} has the unknown value type {raw}") from None


def _skip_strings(cur: _Cursor, count: int, what: str) -> int:
    """The offset just past `count` strings from the cursor: one length read per string, no string built.
    unpack_from checks each length's 8 bytes against the map; the last string's end is checked here."""
    unpack, buf, off = _U64.unpack_from, cur.buf, cur.off
    try:
        for _ in range(count):
            off += 8 + unpack(buf, off)[0]
    except (struct.error, OverflowError):  # a length past the end, or an offset too large to index with
        raise GGUFError(f"{what} runs past the end of the file ({cur.size} bytes)") from None
    if off > cur.size:
        raise GGUFError(f"{what} runs past the end of the file (byte {off} of {cur.size})")
    return off


def _strings(buf: mmap.mmap, off: int, count: int, name: str) -> Iterator[str]:
    """The `count` strings from `off`, which `_skip_strings` has already checked against the file's size."""
    unpack = _U64.unpack_from
    for i in range(count):
        n = unpack(buf, off)[0]
        yield _decode(buf[off + 8 : off + 8 + n], f"item {i} of {name!r}")
        off += 8 + n


def _decode(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGUFError(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    """(name, dims in ggml order, ggml type, data offset) of tensor #i."""
    name = cur.string(f"tensor #{i}'s name")
    what = f"tensor {name!r}'s table entry"
    n_dims = cur.unpack(_U32, what)[0]
    dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.take(8 * n_dims, what))
    raw_type, offset = cur.unpack(_TYPE_OFFSET, what)
    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError:
        raise GGUFError(f"tensor {name!r} has the unknown ggml type {raw_type}") from None
    return name, dims, kind, offset


def _alignment(fields: dict[str, GGUFField]) -> int:
    f = fields.get("general.alignment")
    if f is None:
        return DEFAULT_ALIGNMENT
    if f.type != GGUFValueType.UINT32:
        raise GGUFError(f"general.alignment is a {f.type.name}, not a UINT32")
    if f.value == 0 or f.value & (f.value - 1):
        raise GGUFError(f"general.alignment is {f.value}, not a power of two")
    return int(f.value)


def _check_layout(tensors: list[GGUFTensor], data_start: int, alignment: int) -> None:
    """Each tensor's data starts where the one before it ends, padded to the alignment, as every GGUF writer lays
    them out and llama.cpp requires: an overlap or a gap means a corrupt table (an offset or a type changed)."""
    expected = 0
    for t in tensors:
        at = t.data_offset - data_start
        if at != expected:
            raise GGUFError(f"tensor {t.name!r} starts at data offset {at}, where the tensors before it end at "
                            f"{expected}: the tensor table is corrupt (an offset or a type changed)")  # fmt: skip
        expected += -(-t.n_bytes // alignment) * alignment


def _tensor(
    whole: np.ndarray[Any, Any], data_start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
    offset: int,
) -> GGUFTensor:  # fmt: skip
    """The tensor's entry, with its bytes checked to lie inside the file and viewed in place."""
    block, type_size = GGML_QUANT_SIZES[kind]
    row = dims[0] if dims else 1
    if row % block:
        raise GGUFError(f"tensor {name!r}: rows of {row} elements are not whole {kind.name} blocks of {block}")
    n_elements = math.prod(dims)
    n_bytes = n_elements // block * type_size
    start = data_start + offset
    if start + n_bytes > whole.size:
        raise GGUFError(f"tensor {name!r} holds {max(0, whole.size - start)} of its {n_bytes} bytes")
    shape = tuple(reversed(dims))  # numpy order: [..., rows, row]
    raw = whole[start : start + n_bytes]
    if kind in _ELEMENTS:
        data = raw.view(_ELEMENTS[kind]).reshape(shape)
    else:
        data = raw.reshape(*shape[:-1], row // block * type_size)
    return GGUFTensor(name, kind, dims, n_elements, n_bytes, start, data)

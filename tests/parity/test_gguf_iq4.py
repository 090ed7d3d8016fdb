"""GGUF files with IQ4_NL and IQ4_XS tensors: written here with the gguf package's writer (from blocks this test
quantizes itself, since the gguf package has no IQ4 quantizer), and by llama.cpp's llama-quantize where it is at
hand. The blocks load into their own kernels (no dense copy), the kernels' weights are gguf's dequantization exactly,
their logits are the pure-torch reference's on the dequantized weights, and the packed weight cache keeps them."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.parity.test_gguf_kquants import _wide_llama
from tests.parity.test_gguf_loading import PROMPTS, _greedy, _llama_quantize, _logits
from tests.parity.test_packed_cache import _weights
from tokenmill import LLM
from tokenmill.bench.gguf_export import export_gguf
from tokenmill.kernels import formats
from tokenmill.kernels.kformats import IQ4_LEVELS, KBlockWeight, encode_gguf_rows
from tokenmill.models.linear import KernelLinear, SegmentedLinear
from tokenmill.models.packed_embedding import PackedEmbedding
from tokenmill.weights import packed_cache

# a fused qkv whose v is another type (a SegmentedLinear), whole projections in each type
IQ4_TYPES = {"blk.0.attn_q.weight": "iq4_nl", "blk.0.attn_k.weight": "iq4_nl", "blk.0.attn_v.weight": "iq4_xs",
             "blk.0.ffn_down.weight": "iq4_xs", "blk.1.ffn_down.weight": "iq4_nl",
             "blk.1.attn_output.weight": "iq4_xs", "blk.1.ffn_gate.weight": "iq4_xs",
             "blk.1.ffn_up.weight": "iq4_xs", "token_embd.weight": "iq4_nl"}  # fmt: skip


def _nearest_levels(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [R, 32] over scale [R] -> the index of the nearest IQ4 level of each x / scale, uint8 [R, 32]."""
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32)
    inv = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    return ((x * inv[:, None])[..., None] - levels).abs().argmin(-1).to(torch.uint8)


def iq4_blocks(w: torch.Tensor, fmt: str) -> np.ndarray:
    """A plain IQ4 quantizer (not ggml's, which searches its scales; any valid blocks do here): float [N, K] ->
    the GGUF's bytes [N, K / sb * block bytes]. A block's scale maps its largest magnitude to level -127."""
    n, k = w.shape
    subs = w.float().reshape(-1, 32)  # [R, 32]
    amax = subs.abs().amax(1) / 127  # [R]: each sub-block's own scale
    if fmt == "iq4_nl":
        d = amax.half()
        q = _nearest_levels(subs, d.float())
        return encode_gguf_rows(KBlockWeight(fmt, q.view(n, k), d.view(n, -1))).numpy()
    d = (amax.view(-1, 8).amax(1) / 31).half()  # [R / 8]: a 6-bit scale (ls - 32 <= 31) per sub-block of 32
    sc = torch.round(amax.view(-1, 8) / d.float().clamp(min=1e-30)[:, None]).clamp(-32, 31)  # [R / 8, 8]
    q = _nearest_levels(subs, (d.float()[:, None] * sc).reshape(-1))
    return encode_gguf_rows(KBlockWeight(fmt, q.view(n, k), d.view(n, -1), sc=sc.to(torch.int8).view(n, -1))).numpy()


def retyped(src: Path, dst: Path, types: dict[str, str], encode: Any = None) -> Path:
    """The GGUF `src` again at `dst`, its tensors named in `types` in that IQ4 type (the others as they are);
    `encode(name, values, type) -> blocks` where given, for another type or other values."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer's own
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        data = np.array(t.data)
        if t.name in types:
            raw = encode(t.name, data, types[t.name]) if encode else iq4_blocks(torch.from_numpy(data), types[t.name])
            writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType[types[t.name].upper()])
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# each projection of a layer and the file's tensors it holds, in its rows' order
PROJECTIONS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
               "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}  # fmt: skip


def _assert_linears_hold_the_file(llm: LLM, path: Path) -> int:
    """Each IQ4 tensor's rows of its projection (a kernel linear, or a shard of a SegmentedLinear of that format)
    hold gguf's dequantization of it exactly. The llama arch's q and k rows are permuted back on loading, so those
    two are checked through the logits only. Returns how many tensors it checked."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    checked = 0
    for i, layer in enumerate(llm.loaded.model.model.layers):
        for attr, names in PROJECTIONS.items():
            module = layer.get_submodule(attr)
            parts = list(module.parts) if isinstance(module, SegmentedLinear) else [module]
            rows = 0
            for name in names:
                t = tensors[f"blk.{i}.{name}.weight"]
                n = int(t.shape[1])
                kind = t.tensor_type.name
                if kind in ("IQ4_NL", "IQ4_XS") and name not in ("attn_q", "attn_k"):
                    part = _part_at(parts, rows)
                    assert isinstance(part, KernelLinear) and part.format == kind.lower(), (i, name, part)
                    got = torch.cat([formats.unpack(p.packed()) for p in parts])[rows : rows + n]
                    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
                    assert torch.equal(got, want.view(got.shape)), (i, name)
                    checked += 1
                rows += n
    return checked


def _part_at(parts: list[torch.nn.Module], row: int) -> torch.nn.Module:
    """The part of a projection whose rows include `row`."""
    for part in parts:
        if row < part.out_features:
            return part
        row -= part.out_features
    raise AssertionError(f"row {row} past the projection")


def test_iq4_tensors_run_in_their_own_kernels(
    make_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IQ4_NL and IQ4_XS tensors, mixed as a llama-quantize file mixes types: every linear keeps its file's blocks
    (a qkv of both types as one kernel linear per shard), and so does the token embedding; the kernels' logits are
    the pure-torch reference's on the dequantized weights, the decode stack agrees with the modules' path, and a
    second load maps the packed cache."""
    monkeypatch.setattr(packed_cache, "cache_root", lambda: tmp_path / "packed")
    f32 = export_gguf(_wide_llama(make_checkpoint), tmp_path / "f32.gguf", "f32")
    path = retyped(f32, tmp_path / "iq4.gguf", IQ4_TYPES)
    gg = LLM(str(path), dtype="float32")
    # blk.0's q, k and blk.1's down in IQ4_NL; blk.0's v, down and blk.1's o, gate|up in IQ4_XS; the rest F32
    assert gg.loaded.kernels == {"iq4_nl": 3, "iq4_xs": 4, "f32": 4}, gg.loaded.kernels
    qkv = gg.loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, SegmentedLinear) and [p.format for p in qkv.parts] == ["iq4_nl", "iq4_nl", "iq4_xs"]
    assert _assert_linears_hold_the_file(gg, path) == 6  # all but the q, k rows llama's layout permutes
    emb = gg.loaded.model.embeddings()  # looked up in its blocks: each row gguf's dequantization of it
    assert isinstance(emb, PackedEmbedding) and emb.format == "iq4_nl"
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).view(emb.num_embeddings, -1)
    rows = torch.tensor([0, 5, 383, 17])
    assert torch.equal(emb(rows), table[rows])
    ref = LLM(str(path), dtype="float32", cpu_kernels=False)  # the same blocks dequantized, multiplied in torch
    ids = gg.loaded.tokenizer.encode(PROMPTS[0])
    # as for the K family (test_gguf_kquants.py): each linear agrees to float rounding, and through the model an
    # activation at a rounding boundary of its Q8_0 block may round the other way
    torch.testing.assert_close(_logits(gg, ids), _logits(ref, ids), rtol=0, atol=5e-2)
    modules = LLM(str(path), dtype="float32", batch_invariant=True)
    assert modules.engine.runner.decode_stack is None and gg.engine.runner.decode_stack is not None
    assert _greedy(gg, PROMPTS) == _greedy(modules, PROMPTS)
    (entry,) = (tmp_path / "packed").glob("*.bin")  # the packed cache the first load wrote
    written = entry.stat().st_mtime_ns
    cached = LLM(str(path), dtype="float32")  # maps it (test_packed_cache.py: from its pages)
    assert entry.stat().st_mtime_ns == written  # read, not written again
    first, again = _weights(gg), _weights(cached)
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    assert torch.equal(_logits(cached, ids), _logits(gg, ids))


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS"])
def test_files_from_llama_quantize_load_what_they_hold(
    make_checkpoint: Callable[..., Path], tmp_path: Path, kind: str
) -> None:
    """llama.cpp's own IQ4 files (its quantizer's blocks, its choice of types per tensor): every IQ4 tensor runs in
    its kernel holding exactly the file's values, and the logits are the pure-torch reference's."""
    exe = _llama_quantize()
    if exe is None:
        pytest.skip("llama.cpp's llama-quantize is not on PATH nor in $LLAMA_QUANTIZE (the optional llama.cpp peer)")
    f32 = export_gguf(_wide_llama(make_checkpoint), tmp_path / "f32.gguf", "f32")
    out = tmp_path / f"{kind}.gguf"
    proc = subprocess.run([exe, str(f32), str(out), kind], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert kind in kinds, kinds
    gg = LLM(str(out), dtype="float32")
    assert kind.lower() in gg.loaded.kernels, gg.loaded.kernels
    assert _assert_linears_hold_the_file(gg, out) > 0
    ref = LLM(str(out), dtype="float32", cpu_kernels=False)
    ids = gg.loaded.tokenizer.encode(PROMPTS[0])
    # as above; the file's K-quant tensors take rows with one scale per superblock (as ggml's Q8_K), so an activation
    # that rounds the other way moves by a coarser step
    torch.testing.assert_close(_logits(gg, ids), _logits(ref, ids), rtol=0, atol=8e-2)

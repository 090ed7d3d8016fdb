"""GGUF files with MXFP4 tensors (gpt-oss's expert format), written here with the gguf package's own MXFP4 quantizer:
the blocks load into the MXFP4 kernels (no dense copy) holding gguf's dequantization exactly, and the logits are the
pure-torch reference's on the dequantized weights. A tensor whose block scales no fp16 holds loads dequantized."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from tests.parity.test_gguf_iq4 import retyped
from tests.parity.test_gguf_kquants import _wide_llama
from tests.parity.test_gguf_loading import PROMPTS, _greedy, _logits
from tokenmill import LLM
from tokenmill.bench.gguf_export import export_gguf
from tokenmill.kernels import formats
from tokenmill.models.linear import KernelLinear

MXFP4 = ("blk.0.ffn_down.weight", "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight")
TINY_SCALES = "blk.0.attn_output.weight"  # its blocks' scales ~2^-45: under what an fp16 scale holds


def _mxfp4(name: str, data: np.ndarray, kind: str) -> np.ndarray:
    """gguf's MXFP4 blocks of `data` (TINY_SCALES' scaled down first, under what an fp16 scale holds)."""
    data = data * np.float32(2.0**-40) if name == TINY_SCALES else data
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4)


def test_mxfp4_tensors_run_in_their_own_kernels(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    f32 = export_gguf(_wide_llama(make_checkpoint), tmp_path / "f32.gguf", "f32")
    path = retyped(f32, tmp_path / "mxfp4.gguf", dict.fromkeys((*MXFP4, TINY_SCALES), "mxfp4"), _mxfp4)
    gg = LLM(str(path), dtype="float32")
    assert gg.loaded.kernels.get("mxfp4") == 2, gg.loaded.kernels  # blk.0's down, blk.1's gate|up
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    layers = gg.loaded.model.model.layers

    def dequantized(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).view(-1, int(t.shape[0]))

    down, gate_up = layers[0].mlp.down_proj, layers[1].mlp.gate_up_proj
    assert isinstance(down, KernelLinear) and down.format == "mxfp4"
    assert torch.equal(formats.unpack(down.packed()), dequantized(MXFP4[0]))
    gate_up_file = torch.cat([dequantized(MXFP4[1]), dequantized(MXFP4[2])])
    assert isinstance(gate_up, KernelLinear) and torch.equal(formats.unpack(gate_up.packed()), gate_up_file)
    o_proj = layers[0].self_attn.o_proj
    assert not (isinstance(o_proj, KernelLinear) and o_proj.format == "mxfp4")  # dequantized, as the file holds it
    ref = LLM(str(path), dtype="float32", cpu_kernels=False)  # the blocks dequantized, multiplied in torch
    ids = gg.loaded.tokenizer.encode(PROMPTS[0])
    torch.testing.assert_close(_logits(gg, ids), _logits(ref, ids), rtol=0, atol=5e-2)
    modules = LLM(str(path), dtype="float32", batch_invariant=True)
    assert _greedy(gg, PROMPTS) == _greedy(modules, PROMPTS)

"""`--quantization q4_k_m` / `q5_k_m` give each matrix the type llama-quantize's Q4_K_M / Q5_K_M give it in a GGUF
of the same model (with LLAMA_QUANTIZE or llama-quantize on PATH: the optional llama.cpp peer)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import target
from tests.parity.test_gguf_loading import _llama_quantize
from tokenmill.assembly.model import load
from tokenmill.bench.gguf_export import export_gguf
from tokenmill.config import EngineConfig
from tokenmill.models.linear import KernelLinear, SegmentedLinear
from tokenmill.weights.gguf_reader import GGUFFile

LAYERS = 9  # more_bits then picks layers 0, 3, 6, 7 and 8: every rule of the recipe has a layer


@pytest.mark.parametrize(("mix", "kind"), [("q4_k_m", "Q4_K_M"), ("q5_k_m", "Q5_K_M")])
def test_each_matrix_takes_llama_quantizes_type(
    make_checkpoint: Callable[..., Path], tmp_path: Path, mix: str, kind: str
) -> None:
    target.cpu_only()
    exe = _llama_quantize()
    if exe is None:
        pytest.skip("llama.cpp's llama-quantize is not on PATH nor in $LLAMA_QUANTIZE (the optional llama.cpp peer)")
    folder = make_checkpoint("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)  # fmt: skip
    f32 = export_gguf(folder, tmp_path / "f32.gguf", "f32", name="tiny-random")
    proc = subprocess.run([exe, str(f32), str(tmp_path / "mix.gguf"), kind], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = {t.name: t.tensor_type.name.lower() for t in GGUFFile(tmp_path / "mix.gguf").tensors}
    model = load(EngineConfig(model=str(folder), dtype="bfloat16", quantization=mix)).model
    assert model.lm_head.format == theirs["output.weight"]
    for i, layer in enumerate(model.model.layers):
        qkv, attn = layer.self_attn.qkv_proj, f"blk.{i}.attn"
        parts = qkv.parts if isinstance(qkv, SegmentedLinear) else [qkv, qkv]
        assert isinstance(parts[0], KernelLinear)
        assert (parts[0].format, parts[-1].format) == (theirs[f"{attn}_q.weight"], theirs[f"{attn}_v.weight"]), i
        assert theirs[f"{attn}_k.weight"] == parts[0].format
        assert layer.mlp.down_proj.format == theirs[f"blk.{i}.ffn_down.weight"], i
        assert layer.self_attn.o_proj.format == theirs[f"{attn}_output.weight"], i

"""Mixture-of-experts GGUF files (qwen3moe; Mixtral as a `llama` file with experts) in their own kernels.

- Each expert's rows come out of the layer's [E, rows, cols] tensor in the file, in its blocks: every expert's
  kernel weight is gguf's dequantization of its slice exactly, and Q8_0 / K-quant files hold the bytes our own
  --quantization writes, so both give the same logits.
- A file made by llama.cpp's own llama-quantize (Q4_K_M: experts in Q4_K, some down projections in Q6_K) loads what
  it holds.
- The variants the MoE code does not run (shared experts, a sigmoid router, an expert tensor that is not 3-D) are
  one line at load.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.parity.test_gguf_loading import (
    SPREAD,
    _greedy,
    _llama_quantize,
    _logits,
    _quantized_checkpoint,
)
from tokenmill import LLM
from tokenmill.bench.gguf_export import export_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.kernels import formats
from tokenmill.models.linear import KernelLinear
from tokenmill.models.moe import SparseMoE

PROMPTS = ["To be, or not to be, that is the question.", "Hello world! The quick brown fox"]
# K-quants need rows of 256: hidden size and experts' width 256
WIDE = dict(hidden_size=256, intermediate_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
            norm_topk_prob=True, **SPREAD)  # fmt: skip


def _experts(llm: LLM) -> list[tuple[int, SparseMoE]]:
    return [(i, layer.mlp) for i, layer in enumerate(llm.loaded.model.model.layers) if isinstance(layer.mlp, SparseMoE)]


def _assert_experts_hold_the_file(llm: LLM, path: Path) -> set[str]:
    """Every expert's gate|up and down weight is the file's expert tensor's slice, dequantized by gguf; returns the
    experts' kernel formats."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    kinds = set()
    for layer, moe in _experts(llm):
        stacked = {}
        for proj in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            values = gguf.quants.dequantize(t.data, t.tensor_type)  # [E, rows, cols]
            stacked[proj] = torch.from_numpy(np.ascontiguousarray(values))
        for e, expert in enumerate(moe.experts):
            for module, want in ((expert.gate_up_proj, torch.cat([stacked["gate"][e], stacked["up"][e]])),
                                 (expert.down_proj, stacked["down"][e])):  # fmt: skip
                assert isinstance(module, KernelLinear)
                assert torch.equal(formats.unpack(module.packed()), want), (layer, e)
                kinds.add(module.format)
    return kinds


@pytest.mark.parametrize("dtype,quantization", [("q8_0", "int8"), ("q4_k", "q4_k"), ("q6_k", "q6_k")])
def test_quantized_moe_file_equals_our_quantization(
    make_checkpoint: Callable[..., Path], tmp_path: Path, dtype: str, quantization: str
) -> None:
    ckpt = _quantized_checkpoint(make_checkpoint, "qwen3_moe", dtype, tmp_path, **WIDE)
    path = export_gguf(ckpt, tmp_path / f"moe-{dtype}.gguf", dtype)
    gg = LLM(str(path), dtype="float32")
    assert _assert_experts_hold_the_file(gg, path) == {dtype}
    ours = LLM(str(ckpt), dtype="float32", quantization=quantization)
    for (_, a), (_, b) in zip(_experts(gg), _experts(ours), strict=True):
        for x, y in zip(a.experts, b.experts, strict=True):
            assert torch.equal(x.gate_up_proj.packed().data, y.gate_up_proj.packed().data)
            assert torch.equal(x.down_proj.packed().data, y.down_proj.packed().data)
    ids = gg.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(gg, ids), _logits(ours, ids))  # the same numbers everywhere (the router's too)
    assert _greedy(gg, PROMPTS) == _greedy(ours, PROMPTS)


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0"])
def test_moe_files_from_llama_quantize_load_what_they_hold(
    make_checkpoint: Callable[..., Path], tmp_path: Path, kind: str
) -> None:
    exe = _llama_quantize()
    if exe is None:
        pytest.skip("llama.cpp's llama-quantize is not on PATH nor in $LLAMA_QUANTIZE (the optional llama.cpp peer)")
    f32 = export_gguf(make_checkpoint("qwen3_moe", **WIDE), tmp_path / "f32.gguf", "f32")
    out = tmp_path / f"{kind}.gguf"
    proc = subprocess.run([exe, str(f32), str(out), kind], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    gg = LLM(str(out), dtype="float32")
    kinds = _assert_experts_hold_the_file(gg, out)
    assert kinds == ({"q4_k", "q6_k"} if kind == "Q4_K_M" else {"q8_0"}), kinds
    assert [len(t) for t in _greedy(gg, PROMPTS)] == [16, 16]
    # (no token-by-token check against llama.cpp here: it quantizes the activations the router reads, and this tiny
    # model's routing has near-ties (a 2nd and 3rd expert 0.0013 apart in probability) that then flip; F32 files
    # match llama.cpp's greedy tokens: tests/bench/test_gguf_export.py)


def _moe_file(path: Path, **meta: Any) -> Path:
    """A qwen3moe file's metadata with `meta` over it, and just enough tensors for the config to be read."""
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in dict(context_length=512, embedding_length=64, block_count=1, feed_forward_length=96,
                           head_count=4, head_count_kv=2, layer_norm_rms_eps=1e-6, expert_count=4,
                           expert_used_count=2, expert_feed_forward_length=32, **meta).items():  # fmt: skip
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((384, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4 * 32, 64), dtype=np.float32))  # 2-D: not experts
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_moe_variants_we_do_not_run_are_one_line_at_load(tmp_path: Path) -> None:
    from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint

    with pytest.raises(ModelLoadError, match="2 shared experts is not supported; supported: a softmax router"):
        GGUFCheckpoint(_moe_file(tmp_path / "shared.gguf", expert_shared_count=2)).hf_config()
    sigmoid = gguf.ExpertGatingFuncType.SIGMOID
    with pytest.raises(ModelLoadError, match="router gating function 2 is not supported"):
        GGUFCheckpoint(_moe_file(tmp_path / "sigmoid.gguf", expert_gating_func=sigmoid)).hf_config()
    plain = GGUFCheckpoint(_moe_file(tmp_path / "plain.gguf"))
    config = plain.hf_config()
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 32)
    assert config["norm_topk_prob"] is True and config["mlp_only_layers"] == []
    with pytest.raises(ModelLoadError, match=r"blk.0.ffn_gate_exps.weight has shape \[64, 128\]; an expert tensor is"):
        list(plain.iter_tensors(config))


def test_an_older_mixtral_file_with_one_tensor_per_expert_loads_alike(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Mixtral files written before llama.cpp stacked the experts hold `blk.N.ffn_gate.E.weight`, one per expert:
    such a file gives the stacked file's logits."""
    ckpt = make_checkpoint("mixtral", num_local_experts=4, num_experts_per_tok=2, **SPREAD)
    stacked = export_gguf(ckpt, tmp_path / "stacked.gguf", "f32")
    reader = gguf.GGUFReader(stacked)
    writer = gguf.GGUFWriter(tmp_path / "per-expert.gguf", "llama")
    for field in reader.fields.values():  # every key but the ones the writer writes itself
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value, kind = field.contents(), field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if "_exps." in t.name:  # [E, rows, cols] -> E tensors, blk.N.ffn_gate.E.weight
            for e in range(data.shape[0]):
                writer.add_tensor(t.name.replace("_exps.weight", f".{e}.weight"), np.ascontiguousarray(data[e]))
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    old, new = LLM(str(tmp_path / "per-expert.gguf")), LLM(str(stacked))
    ids = new.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(old, ids), _logits(new, ids))

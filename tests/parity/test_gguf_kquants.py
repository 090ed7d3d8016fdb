"""GGUF files in the K family (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q4_1), written here by our exporter from tiny random
checkpoints: the blocks load into their own kernels unchanged (a mixed fused projection as one kernel linear per
shard), the kernels' logits are the pure-torch reference's, and --quantization's quantizer writes the same blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch

from tests.parity.test_gguf_loading import GREEDY, PROMPTS, SPREAD, _greedy, _kernel_linears, _logits
from tokenmill import LLM
from tokenmill.bench.gguf_export import export_gguf
from tokenmill.kernels import formats
from tokenmill.models.linear import SegmentedLinear
from tokenmill.models.packed_embedding import PackedEmbedding

K_TYPES = {"blk.0.attn_v.weight": "q6_k", "blk.1.attn_v.weight": "q8_0", "blk.1.ffn_down.weight": "q5_k",
           "blk.0.ffn_down.weight": "q5_0",
           "blk.1.attn_output.weight": "q4_1", "blk.0.attn_output.weight": "q5_1",
           "token_embd.weight": "f32"}  # fmt: skip


def _wide_llama(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", hidden_size=256, intermediate_size=512, **SPREAD)  # K-quants need rows of 256


def test_k_family_tensors_run_in_their_own_kernels(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A Q4_K file with the other K-family types mixed in, as llama-quantize's Q4_K_M mixes them: every linear keeps
    its file's blocks (the kernels' weight is gguf's dequantization exactly), a fused qkv whose v is another type
    keeps one kernel linear per shard, and the kernels' logits are the pure-torch reference's."""
    path = export_gguf(_wide_llama(make_checkpoint), tmp_path / "q4_k.gguf", "q4_k", overrides=K_TYPES)
    gg = LLM(str(path), dtype="float32")
    assert set(gg.loaded.kernels) == {"q4_k", "q6_k", "q8_0", "q5_k", "q5_0", "q4_1", "q5_1"}
    layers = gg.loaded.model.model.layers
    qkv = layers[0].self_attn.qkv_proj
    assert isinstance(qkv, SegmentedLinear) and [p.format for p in qkv.parts] == ["q4_k", "q4_k", "q6_k"]
    # a Q8_0 v beside K-quants: both shards read rows with one scale per superblock (and Q8_0's unsigned copy)
    qkv1 = layers[1].self_attn.qkv_proj
    assert isinstance(qkv1, SegmentedLinear) and [p.row_group for p in qkv1.parts] == [0, 0, 256]
    assert gg.engine.runner.decode_stack is not None  # which decodes the mixed qkvs as segments
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, module in [("blk.0.attn_v.weight", qkv.parts[2]), ("blk.1.ffn_down.weight", layers[1].mlp.down_proj),
                         ("blk.0.ffn_down.weight", layers[0].mlp.down_proj),
                         ("blk.1.attn_output.weight", layers[1].self_attn.o_proj),
                         ("blk.0.attn_output.weight", layers[0].self_attn.o_proj)]:  # fmt: skip
        t = tensors[name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(formats.unpack(module.packed()), want.view(module.out_features, -1)), name
    ref = LLM(str(path), dtype="float32", cpu_kernels=False)  # the same blocks, multiplied in torch
    ids = gg.loaded.tokenizer.encode(PROMPTS[0])
    # every linear agrees to float rounding (tests/unit/test_kformats.py); through the model, the norms' last bits
    # differ, and an activation at a rounding boundary of its Q8_0 block may round the other way: a few 1e-2 at most
    torch.testing.assert_close(_logits(gg, ids), _logits(ref, ids), rtol=0, atol=5e-2)
    # the decode stack (the mixed qkv as segments) against the modules' path through the same kernels
    modules = LLM(str(path), dtype="float32", batch_invariant=True)
    assert modules.engine.runner.decode_stack is None
    want_tokens = _greedy(modules, PROMPTS)
    assert _greedy(gg, PROMPTS) == want_tokens
    assert [_greedy(gg, [p])[0] for p in PROMPTS] == want_tokens  # alone as in the batch
    with pytest.raises(ValueError, match="already holds"):
        LLM(str(path), quantization="int8")


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_1"])
def test_our_quantization_and_the_exported_file_hold_the_same_blocks(
    make_checkpoint: Callable[..., Path], tmp_path: Path, fmt: str
) -> None:
    """--quantization q4_k on the HF folder and the GGUF our exporter writes in q4_k: the same quantizer (ggml's
    reference algorithm), so the same bytes in every kernel linear and the same logits."""
    ckpt = _wide_llama(make_checkpoint)
    path = export_gguf(ckpt, tmp_path / f"{fmt}.gguf", fmt, overrides={"token_embd.weight": "f32"})
    gg = LLM(str(path), dtype="float32")
    ours = LLM(str(ckpt), dtype="float32", quantization=fmt)
    assert gg.loaded.kernels == ours.loaded.kernels == {fmt: 2 * 4 + 1}
    for (name, a), (_, b) in zip(_kernel_linears(gg), _kernel_linears(ours), strict=True):
        assert torch.equal(a.data, b.data), name
    ids = ours.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(gg, ids), _logits(ours, ids))


def test_a_k_quant_falls_back_where_rows_are_not_superblocks(make_checkpoint: Callable[..., Path]) -> None:
    """Rows of 64 (not a multiple of 256): --quantization q4_k gives those linears Q5_0, as llama-quantize does."""
    llm = LLM(str(make_checkpoint("qwen2", **SPREAD)), dtype="float32", quantization="q4_k")
    assert llm.loaded.kernels == {"q5_0": 2 * 4 + 1}
    assert len(_greedy(llm, PROMPTS[:1])[0]) == GREEDY.max_tokens


@pytest.mark.parametrize("fmt", ["q8_0", "q6_k"])
def test_a_quantized_embedding_stays_in_its_blocks(
    make_checkpoint: Callable[..., Path], tmp_path: Path, fmt: str
) -> None:
    """A quantized token_embd is looked up in its own blocks (no dense table beside the file's), a tied LM head
    multiplies by the very same panels, and the decode stack reads its rows itself: the same tokens as the modules'
    path, and each looked-up row is gguf's dequantization of that row."""
    ckpt = make_checkpoint("qwen2", hidden_size=256, intermediate_size=512, tie_word_embeddings=True, **SPREAD)
    path = export_gguf(ckpt, tmp_path / f"{fmt}.gguf", fmt)
    gg = LLM(str(path), dtype="float32")
    emb = gg.loaded.model.embeddings()
    assert isinstance(emb, PackedEmbedding) and emb.format == fmt
    assert gg.loaded.model.lm_head.data is emb.data  # one copy of the panels
    stack = gg.engine.runner.decode_stack
    assert stack is not None and stack.greedy_ready
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).view(emb.num_embeddings, -1)
    ids = torch.tensor([0, 5, 383, 17])
    assert torch.equal(emb(ids), table[ids])
    modules = LLM(str(path), dtype="float32", batch_invariant=True)
    assert _greedy(gg, PROMPTS) == _greedy(modules, PROMPTS)
    plain = LLM(str(path), dtype="float32", cpu_kernels=False)  # no kernels: the table dense, the same rows
    emb_plain = plain.loaded.model.embeddings()
    assert type(emb_plain) is torch.nn.Embedding and torch.equal(emb_plain(ids), table[ids])

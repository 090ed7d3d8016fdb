"""`make-model --gguf TYPE`: a GGUF of random weights written straight, streamed tensor by tensor; its types follow
llama-quantize's recipe, tokenmill (and llama.cpp, where installed) run it, and the writer never holds the weights."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.bench.gguf_random import write_random_gguf
from tokenmill.model_config import RopeConfig
from tokenmill.models.moe import SparseMoE

# rows of 256 (K-quants), two layers, four experts (the first layer's down projection is Q6_K in Q4_K_M)
WIDE_MOE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=384, max_position_embeddings=512,
                tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                norm_topk_prob=True)  # fmt: skip


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_a_q4_k_m_moe_file_has_llama_quantizes_types_and_runs(tokenizer_dir: Path, tmp_path: Path) -> None:
    target.cpu_only("the CPU kernels' formats")
    path = write_random_gguf("qwen3_moe", WIDE_MOE, tokenizer_dir, tmp_path / "moe.gguf", "q4_k_m", seed=0)
    types = _types(path)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    for layer, v in ((0, "Q4_K"), (1, "Q6_K")):  # of two layers, the last is a "more bits" one (quant_mix.more_bits)
        assert types[f"blk.{layer}.attn_v.weight"] == types[f"blk.{layer}.ffn_down_exps.weight"] == v
        assert types[f"blk.{layer}.ffn_gate_exps.weight"] == types[f"blk.{layer}.attn_q.weight"] == "Q4_K"
        assert types[f"blk.{layer}.ffn_gate_inp.weight"] == "F32"
    llm = LLM(str(path))
    moe = [m for m in llm.loaded.model.modules() if isinstance(m, SparseMoE)][-1]  # the last layer's
    assert {moe.experts[0].gate_up_proj.format, moe.experts[0].down_proj.format} == {"q4_k", "q6_k"}
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    if importlib.util.find_spec("llama_cpp") is not None:  # llama.cpp reads the file as one of its own
        from tokenmill.bench.llamacpp_backend import run_llamacpp

        ran = run_llamacpp(path, [[1, 2, 3]], max_tokens=4, n_threads=1, n_ctx=64, warmup=False)
        assert ran["runs"][0]["completion_tokens"] == 4


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_a_dense_file_of_each_type_loads(tokenizer_dir: Path, tmp_path: Path, kind: str) -> None:
    fields = {k: v for k, v in WIDE_MOE.items() if "expert" not in k and k != "norm_topk_prob"}
    path = write_random_gguf("qwen2", fields, tokenizer_dir, tmp_path / f"{kind}.gguf", kind, seed=0)
    types = _types(path)
    assert types["blk.1.ffn_down.weight"] == kind.upper() and types["blk.0.attn_q.bias"] == "F32"
    assert len(LLM(str(path)).generate(["Hi"], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids)


def test_a_llama3_scaled_rope_goes_into_the_file(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Llama 3's scaled RoPE (Llama-3.2's shapes) is written as llama.cpp's `rope_freqs`, and the model loaded from
    the file rotates by the frequencies the config gives (a file without it would rotate by the plain ones)."""
    from tokenmill.make_model import hf_config
    from tokenmill.models import family_named
    from tokenmill.models.rope import rope_inv_freq

    fields = {k: v for k, v in WIDE_MOE.items() if "expert" not in k and k != "norm_topk_prob"}
    fields["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=128)  # fmt: skip
    path = write_random_gguf("llama", fields, tokenizer_dir, tmp_path / "l3.gguf", "q8_0", seed=0)
    assert _types(path)["rope_freqs.weight"] == "F32"
    want = family_named("llama").config_from_hf(hf_config("llama", **fields).to_dict()).rope
    assert want.kind == "llama3"
    loaded = LLM(str(path)).loaded.model.config.rope
    got_freq, want_freq = rope_inv_freq(loaded, 64)[0], rope_inv_freq(want, 64)[0]
    assert not torch.equal(want_freq, rope_inv_freq(RopeConfig(want.theta), 64)[0])  # the scaling changes some
    torch.testing.assert_close(got_freq, want_freq, rtol=1e-6, atol=0)


_MEASURE = """
import json, resource, sys
from pathlib import Path
from tokenmill.bench.gguf_random import write_random_gguf
from tokenmill.model_config import RopeConfig
fields, tok, out = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
small = {**fields, "num_hidden_layers": 1, "num_experts": 2}
write_random_gguf("qwen3_moe", small, tok, out.with_suffix(".small"), "q4_k", 0)  # every import and pool made
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_random_gguf("qwen3_moe", fields, tok, out, "q4_k", 0)
print(json.dumps([before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))
"""


def test_the_writer_streams_without_holding_the_weights(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Writing a ~110 MB file raises the writer's peak resident set by far less than the file: it holds one tensor
    (here one layer's experts of one projection, 4.7 MB) at a time."""
    fields: dict[str, Any] = {**WIDE_MOE, "hidden_size": 512, "num_hidden_layers": 8, "num_experts": 32,
                              "moe_intermediate_size": 512}  # fmt: skip
    out = tmp_path / "big.gguf"
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(fields), str(tokenizer_dir), str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = json.loads(proc.stdout.strip().splitlines()[-1])  # KiB
    size = out.stat().st_size
    assert size > 100e6
    assert (after - before) * 1024 < 0.25 * size, (before, after, size)


def test_what_it_cannot_write_is_one_line(tokenizer_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--gguf 'q3_k' is not supported; allowed: f32, bf16"):
        write_random_gguf("qwen3_moe", WIDE_MOE, tokenizer_dir, tmp_path / "x.gguf", "q3_k", seed=0)
    with pytest.raises(ValueError, match="Llama-shaped families .* not gpt2"):
        write_random_gguf("gpt2", {}, tokenizer_dir, tmp_path / "x.gguf", "q8_0", seed=0)
    assert not (tmp_path / "x.gguf").exists()


def test_a_gpt_oss_mxfp4_file_has_the_released_types_and_runs(tokenizer_dir: Path, tmp_path: Path) -> None:
    """`--gguf mxfp4` at a gpt-oss shape: the `gpt-oss` arch with its experts in MXFP4 and the other matrices in
    Q8_0 (llama.cpp's MXFP4_MOE, as the released files hold them); tokenmill runs the experts in its MXFP4 kernels,
    and llama.cpp (where installed) reads the file as one of its own."""
    target.cpu_only("the CPU kernels' formats")
    fields = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=384, max_position_embeddings=512,
                  num_local_experts=4, num_experts_per_tok=2, sliding_window=8)  # fmt: skip
    path = write_random_gguf("gpt_oss", fields, tokenizer_dir, tmp_path / "oss.gguf", "mxfp4", seed=0)
    types = _types(path)
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_up_exps.bias"] == types["blk.0.attn_sinks.weight"] == "F32"
    llm = LLM(str(path))
    assert llm.loaded.kernels.get("mxfp4") == 2 * 2 * 4, llm.loaded.kernels  # gate|up and down, 4 experts, 2 layers
    assert llm.loaded.config.layer_windows() == [8, None]
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    if importlib.util.find_spec("llama_cpp") is not None:
        from tokenmill.bench.llamacpp_backend import run_llamacpp

        ran = run_llamacpp(path, [[1, 2, 3]], max_tokens=4, n_threads=1, n_ctx=64, warmup=False)
        assert ran["runs"][0]["completion_tokens"] == 4

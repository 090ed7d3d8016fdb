"""HF -> GGUF export: the file's metadata and tensors, and (with llama-cpp-python) llama.cpp's greedy tokens and
tokenization equal transformers' on the same weights: proof that names, Q/K permutation and RoPE are right."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tokenmill.bench.gguf_export import export_gguf
from tokenmill.bench.llamacpp_backend import BackendUnavailable, run_llamacpp

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # fmt: skip
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
# name -> (make_checkpoint arch, overrides, GGUF arch); initializer_range 0.1 gives clear argmax margins
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {"initializer_range": 0.1}, "llama"),
    "llama3-rope": ("llama", {"initializer_range": 0.1, "rope_scaling": LLAMA3_ROPE}, "llama"),
    "mistral": ("mistral", {"initializer_range": 0.1}, "llama"),
    "qwen2": ("qwen2", {"initializer_range": 0.1}, "qwen2"),
    "qwen2-tied": ("qwen2", {"initializer_range": 0.1, "tie_word_embeddings": True}, "qwen2"),
    "qwen3": ("qwen3", {"initializer_range": 0.1}, "qwen3"),
    "gpt2": ("gpt2", {"initializer_range": 0.1}, "gpt2"),
    "gemma3": (
        "gemma3",
        {
            "initializer_range": 0.1,
            "head_dim": 16,
            "num_hidden_layers": 6,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
        },
        "gemma3",
    ),
    "phi3": ("phi3", {"initializer_range": 0.1}, "phi3"),
    "qwen3moe": ("qwen3_moe", {"initializer_range": 0.1, **MOE}, "qwen3moe"),
    "mixtral": ("mixtral", {"initializer_range": 0.1, "num_local_experts": 4, "num_experts_per_tok": 2}, "llama"),
}
LLAMA_SHAPED = [f for f in FAMILIES if f not in ("gpt2", "gemma3", "phi3", "qwen3moe", "mixtral")]
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0])  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog. To be, or not to be"


@pytest.fixture(scope="module")
def exported(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, dtype: str = "f32") -> tuple[Path, Path]:
        if (family, dtype) not in cache:
            arch, overrides, _ = FAMILIES[family]
            ckpt = make_checkpoint(arch, **overrides)
            out = export_gguf(ckpt, tmp_path_factory.mktemp("gguf") / f"{family}-{dtype}.gguf", dtype)
            cache[family, dtype] = ckpt, out
        return cache[family, dtype]

    return get


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def _hf_state(ckpt: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("family", LLAMA_SHAPED)
def test_metadata_and_tensors(exported: Callable[..., Any], family: str) -> None:
    ckpt, path = exported(family)
    config = json.loads((ckpt / "config.json").read_text())
    arch = FAMILIES[family][2]
    r = gguf.GGUFReader(path)
    n_layers, head_dim = config["num_hidden_layers"], config.get("head_dim") or 64 // 4
    assert _field(r, "general.architecture") == arch
    assert _field(r, "general.file_type") == gguf.LlamaFileType.ALL_F32
    assert _field(r, f"{arch}.context_length") == config["max_position_embeddings"] == 512
    assert _field(r, f"{arch}.block_count") == n_layers
    assert _field(r, f"{arch}.embedding_length") == config["hidden_size"]
    assert _field(r, f"{arch}.feed_forward_length") == config["intermediate_size"]
    assert _field(r, f"{arch}.attention.head_count") == config["num_attention_heads"]
    assert _field(r, f"{arch}.attention.head_count_kv") == config["num_key_value_heads"]
    assert _field(r, f"{arch}.attention.key_length") == head_dim
    assert _field(r, f"{arch}.rope.freq_base") == pytest.approx(10000.0)
    assert _field(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(config["rms_norm_eps"])
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    # the test tokenizer is ByteLevel(use_regex=True), but transformers gives `qwen2` checkpoints Qwen2's split regex
    assert _field(r, "tokenizer.ggml.pre") == ("qwen2" if config["model_type"] == "qwen2" else "gpt-2")
    assert len(_field(r, "tokenizer.ggml.tokens")) == config["vocab_size"]
    assert len(_field(r, "tokenizer.ggml.merges")) > 0
    assert _field(r, "tokenizer.ggml.eos_token_id") == config["eos_token_id"]
    assert _field(r, "tokenizer.ggml.bos_token_id") == config["bos_token_id"]
    assert _field(r, "tokenizer.ggml.add_bos_token") is False

    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    per_layer = [f"{n}.weight" for n in per_layer]
    if arch == "qwen2":
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if arch == "qwen3":
        per_layer += ["attn_q_norm.weight", "attn_k_norm.weight"]
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}" for i in range(n_layers) for n in per_layer
    }
    if not config.get("tie_word_embeddings"):
        expected.add("output.weight")
    if family == "llama3-rope":
        expected.add("rope_freqs.weight")
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == expected
    assert _field(r, "GGUF.tensor_count") == len(expected)

    hf = _hf_state(ckpt)
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert list(tensors["blk.0.attn_q.weight"].shape) == list(reversed(q.shape))  # GGUF lists ne0 (columns) first
    assert list(tensors["token_embd.weight"].shape) == [config["hidden_size"], config["vocab_size"]]
    np.testing.assert_array_equal(tensors["blk.1.ffn_down.weight"].data, hf["model.layers.1.mlp.down_proj.weight"])
    got_q = np.asarray(tensors["blk.0.attn_q.weight"].data)
    if arch == "llama":  # rows permuted per head: HF's rotate-half pairs (i, i + d/2) become adjacent (2i, 2i + 1)
        n_head = config["num_attention_heads"]
        heads = q.reshape(n_head, 2, head_dim // 2, -1)
        np.testing.assert_array_equal(got_q.reshape(n_head, head_dim // 2, 2, -1), heads.transpose(0, 2, 1, 3))
    else:
        np.testing.assert_array_equal(got_q, q)


def test_phi3_keeps_its_fused_tensors_and_writes_longrope_and_windows(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """As llama.cpp's converter writes Phi-3: `attn_qkv` and `ffn_up` (gate then up) as HF's fused tensors, the
    window (0: none), LongRoPE as two factor tensors and HF's default cos/sin scale; Mistral's window as the
    `llama` arch's `attention.sliding_window`."""
    ckpt = make_checkpoint("phi3", rope_scaling=LONGROPE, original_max_position_embeddings=64, sliding_window=8)
    r = gguf.GGUFReader(export_gguf(ckpt, tmp_path / "phi3.gguf", "f32"))
    tensors = {t.name: t for t in r.tensors}
    per_layer = ["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
    expected = {"token_embd", "output_norm", "output", "rope_factors_long", "rope_factors_short"}
    assert set(tensors) == {f"{n}.weight" for n in expected} | {
        f"blk.{i}.{n}.weight" for i in (0, 1) for n in per_layer
    }
    hf = _hf_state(ckpt)
    for gguf_name, hf_name in [("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")]:
        np.testing.assert_array_equal(tensors[f"blk.1.{gguf_name}.weight"].data, hf[f"model.layers.1.{hf_name}.weight"])
    for kind in ("long", "short"):
        want = np.asarray(LONGROPE[f"{kind}_factor"], dtype=np.float32)
        np.testing.assert_array_equal(tensors[f"rope_factors_{kind}.weight"].data, want)
    assert _field(r, "phi3.rope.scaling.attn_factor") == pytest.approx((1 + np.log(512 / 64) / np.log(64)) ** 0.5)
    assert _field(r, "phi3.rope.scaling.original_context_length") == 64
    assert _field(r, "phi3.rope.dimension_count") == 16 and _field(r, "phi3.attention.sliding_window") == 8
    assert "phi3.attention.key_length" not in r.fields  # as llama.cpp's converter: hidden / heads
    plain = gguf.GGUFReader(export_gguf(make_checkpoint("phi3"), tmp_path / "plain.gguf", "f32"))
    assert _field(plain, "phi3.attention.sliding_window") == 0  # Phi-3's config: no window
    mistral = gguf.GGUFReader(export_gguf(make_checkpoint("mistral", sliding_window=8), tmp_path / "m.gguf", "f32"))
    assert _field(mistral, "llama.attention.sliding_window") == 8


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_moe_experts_are_stacked_per_layer_and_the_router_stays_f32(exported: Callable[..., Any], family: str) -> None:
    """As llama.cpp's converter writes a MoE: each layer's experts in one [E, rows, cols] tensor per projection, in
    expert order, the router (`ffn_gate_inp`) in F32 whatever the file's type, and the expert counts (qwen3moe: the
    experts' width too)."""
    ckpt, path = exported(family, "bf16")
    config = json.loads((ckpt / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    arch = FAMILIES[family][2]
    r = gguf.GGUFReader(path)
    assert _field(r, f"{arch}.expert_count") == experts and _field(r, f"{arch}.expert_used_count") == 2
    if arch == "qwen3moe":
        assert _field(r, "qwen3moe.expert_feed_forward_length") == width
    tensors = {t.name: t for t in r.tensors}
    assert not any(".ffn_gate.weight" in n or ".ffn_up.weight" in n for n in tensors)  # no dense MLP
    hf = _hf_state(ckpt)
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    names = (
        {"gate": "w1", "down": "w2", "up": "w3"}
        if family == "mixtral"
        else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    )
    for proj, (rows, cols) in (("gate", (width, 64)), ("up", (width, 64)), ("down", (64, width))):
        t = tensors[f"blk.1.ffn_{proj}_exps.weight"]
        assert list(t.shape) == [cols, rows, experts]  # ggml order
        bits = np.asarray(t.data).view(np.uint16).reshape(experts, rows, cols)
        for e in (0, experts - 1):
            want = hf[f"model.layers.1.{moe}.experts.{e}.{names[proj]}.weight"]
            np.testing.assert_array_equal(bits[e], _bf16_bits(want))
    router = tensors["blk.0.ffn_gate_inp.weight"]
    assert router.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(router.data, hf[f"model.layers.0.{moe}.gate.weight"])


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_llama3_rope_factors(exported: Callable[..., Any]) -> None:
    r = gguf.GGUFReader(exported("llama3-rope")[1])
    factors = np.asarray(next(t for t in r.tensors if t.name == "rope_freqs.weight").data)
    assert factors.shape == (8,)  # head_dim 16 / 2
    assert factors[0] == 1.0 and factors[-1] == 8.0  # high frequencies untouched, low ones divided by `factor`
    assert np.all(np.diff(factors) >= 0)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "q8_0"])
def test_export_writes_each_dtype_and_keeps_1d_tensors_f32(exported: Callable[..., Any], dtype: str) -> None:
    ckpt, path = exported("qwen2", dtype)
    r = gguf.GGUFReader(path)
    qtype = {"bf16": "BF16", "f16": "F16", "q8_0": "Q8_0"}[dtype]
    tensors = {t.name: t for t in r.tensors}
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == qtype
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # 1-D tensors stay F32
    assert tensors["blk.0.attn_q.bias"].tensor_type.name == "F32"
    t = tensors["blk.0.ffn_up.weight"]
    got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(96, 64)
    want = _hf_state(ckpt)["model.layers.0.mlp.up_proj.weight"]
    np.testing.assert_allclose(got, want, atol=0.02 * float(np.abs(want).max()), rtol=0.0)


def test_unsupported_architecture_and_dtype(exported: Callable[..., Any], tmp_path: Path) -> None:
    ckpt, _ = exported("qwen2")
    bad = tmp_path / "mamba"
    shutil.copytree(ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"'MambaForCausalLM'.* supported: .*Phi3ForCausalLM"):
        export_gguf(bad, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(ValueError, match="q3_k"):
        export_gguf(ckpt, tmp_path / "y.gguf", "q3_k")


def test_unsupported_tokenizer(exported: Callable[..., Any], tmp_path: Path) -> None:
    ckpt, _ = exported("llama")  # not qwen2: transformers replaces a qwen2 checkpoint's pre-tokenizer with Qwen2's
    bad = tmp_path / "wordpiece"
    shutil.copytree(ckpt, bad)
    spec = json.loads((bad / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (bad / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="Whitespace"):
        export_gguf(bad, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_backend_unavailable_without_llama_cpp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(BackendUnavailable, match=r"tokenmill\[llamacpp\]"):
        run_llamacpp(tmp_path / "missing.gguf", [[1, 2, 3]], 4, 1, 64)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llamacpp_greedy_equals_transformers(exported: Callable[..., Any], family: str) -> None:
    pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, path = exported(family)
    ids = AutoTokenizer.from_pretrained(str(ckpt))(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly n tokens on both sides (llama.cpp: ignore_eos)
    n = 10
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    want = out[0, len(ids) :].tolist()
    got = run_llamacpp(path, [ids], max_tokens=n, n_threads=1, n_ctx=128, warmup=False)
    run = got["runs"][0]
    assert run["token_ids"] == want
    assert run["completion_tokens"] == n and run["prompt_tokens"] == len(ids)
    assert got["load_time_s"] > 0 and run["ttft_ms"] > 0 and got["tokens_per_second"] > 0


def test_llamacpp_refuses_a_prompt_past_its_context_before_any_run(exported: Callable[..., Any]) -> None:
    """A prompt that cannot fit n_ctx with its new tokens is refused before the warmup and the other prompts run."""
    pytest.importorskip("llama_cpp")
    _, path = exported("llama")
    with pytest.raises(ValueError, match=r"prompt of 120 tokens \+ 16 new tokens exceeds n_ctx=128"):
        run_llamacpp(path, [[5, 6, 7], list(range(3, 123))], max_tokens=16, n_threads=1, n_ctx=128)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llamacpp_tokenizes_like_hf(exported: Callable[..., Any], family: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    ckpt, path = exported(family)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = [PROMPT, "Hello world!  Numbers 0 1 23 456, 3.14 it's DON'T we'll   spaces\n\nnew  lines.\t x ", " x"]
    texts.append("<|im_start|>user\nHello<|im_end|>")  # special tokens parsed as single ids, as HF does
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok(text)["input_ids"], text


def test_llamacpp_runs_bf16_and_q8_0(exported: Callable[..., Any]) -> None:
    """In a child process: a native crash (e.g. llama.cpp's AMX Q8_0 kernels) must fail the test, not pytest."""
    pytest.importorskip("llama_cpp")
    paths = [str(exported(family, dtype)[1]) for family in ("llama", "qwen3") for dtype in ("bf16", "q8_0")]
    code = (
        "import sys; from tokenmill.bench.llamacpp_backend import run_llamacpp\n"
        "for p in sys.argv[1:]:\n"
        "    r = run_llamacpp(p, [[5, 6, 7, 8, 9, 10, 11, 12], 'Hello world'], 6, 1, 64)\n"
        "    assert [x['completion_tokens'] for x in r['runs']] == [6, 6], r\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    # -11 (SIGSEGV) here was llama.cpp's AMX Q8_0 matmul in a GGML_NATIVE build on an AMX CPU: build without AMX
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"

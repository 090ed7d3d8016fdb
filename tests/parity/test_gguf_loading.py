"""GGUF files load directly: tiny random HF checkpoints exported to GGUF here (F32, Q8_0, Q4_0, mixed types).

- F32: logits within 1e-4 of loading the HF folder, greedy tokens identical (alone and batched with chunked
  prefill and prefix caching), for every GGUF architecture we load; phi3, a windowed llama (Mistral) file and the
  MoE files (qwen3moe, Mixtral's llama with experts) against transformers itself too.
- Q8_0 / Q4_0: the blocks load unchanged (the kernel's packed bytes equal our own quantizer's on the same
  weights), and greedy tokens equal our int8 / int4 path on the same weights.
- The K family (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q4_1): test_gguf_kquants.py.
- Tokenizers come from the file, and bad files fail with one clear line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import causal
from tokenmill.bench.gguf_export import export_gguf
from tokenmill.kernels import formats
from tokenmill.models.linear import KernelLinear, SegmentedLinear
from tokenmill.tokenizer import Tokenizer

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)  # fmt: skip
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0])  # fmt: skip  # head_dim 16: 8 each
SPREAD = dict(initializer_range=0.1)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True)),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", {}),
    "gpt2": ("gpt2", {}),
    # llama.cpp's gemma3: a global layer every 6th, window 8 (binds here), sliding layers' RoPE base 10000
    "gemma3": ("gemma3", dict(head_dim=16, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16)),
    # Mistral v0.1-style: the window (8; the first prompt has 18 tokens) in every layer of a `llama` file
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "phi3": ("phi3", {}),  # q|k|v and gate|up fused in the file as in HF's checkpoint
    "phi3-window": ("phi3", dict(sliding_window=8)),
    # positions from 8 on rotate by the long factors, as loading the folder does
    "phi3-longrope": ("phi3", dict(rope_scaling=LONGROPE, original_max_position_embeddings=8)),
    # experts stacked per layer and projection in the file ([E, rows, cols]), split per expert at load
    "qwen3moe": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),  # a `llama` file with experts
}
PROMPTS = ["To be, or not to be, that is the question.", "Hello world! The quick brown fox", "Numbers 0 1 2 3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def exported(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(case: str, dtype: str = "f32") -> tuple[Path, Path]:
        if (case, dtype) not in cache:
            arch, overrides = CASES[case]
            ckpt = make_checkpoint(arch, **SPREAD, **overrides)
            # named neutrally: llama.cpp gives a file named like Phi-3 Phi-3's special tokens, which ours lack
            out = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            cache[case, dtype] = ckpt, export_gguf(ckpt, out, dtype, name="tiny-random")
        return cache[case, dtype]

    return get


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [T, V]
    model = llm.loaded.model
    with torch.inference_mode():
        windows = llm.loaded.config.layer_windows()
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), *causal(len(ids), windows)))


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("case", ["phi3", "phi3-window", "mistral-window", "qwen3moe", "mixtral"])
def test_f32_gguf_equals_transformers(exported: Callable[..., Any], case: str) -> None:
    """The file against transformers' own model of the checkpoint it was written from, on a prompt past the window:
    logits to 1e-4, greedy tokens identical."""
    from transformers import AutoModelForCausalLM

    ckpt, path = exported(case)
    gg = LLM(str(path))
    window = CASES[case][1].get("sliding_window")
    assert gg.loaded.config.sliding_window == window  # read from the file
    ids = gg.loaded.tokenizer.encode(" ".join(PROMPTS))
    assert window is None or len(ids) > 4 * window
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly max_tokens, as ignore_eos
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=GREEDY.max_tokens, pad_token_id=0)
    diff = (_logits(gg, ids) - want).abs().max().item()
    assert diff < 1e-4, diff
    got = gg.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
    assert got == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_f32_gguf_equals_the_hf_folder(exported: Callable[..., Any], case: str) -> None:
    ckpt, path = exported(case)
    hf = LLM(str(ckpt), dtype="float32")
    gg = LLM(str(path), max_num_batched_tokens=16, enable_prefix_caching=True)  # chunked prefill
    assert gg.loaded.dtype == torch.float32  # "auto" for an all-F32 file
    assert gg.loaded.config.tie_word_embeddings == hf.loaded.config.tie_word_embeddings
    ids = hf.loaded.tokenizer.encode(PROMPTS[0])
    assert gg.loaded.tokenizer.encode(PROMPTS[0]) == ids  # the tokenizer built from the file's metadata
    diff = (_logits(gg, ids) - _logits(hf, ids)).abs().max().item()
    assert diff < 1e-4, diff
    want = _greedy(hf, PROMPTS)
    assert _greedy(gg, PROMPTS) == want  # batched, chunked
    assert _greedy(gg, PROMPTS[:1] * 2) == [want[0]] * 2  # the second one hits the prefix cache
    assert gg.loaded.eos_token_ids == hf.loaded.eos_token_ids


def _quantized_checkpoint(
    make_checkpoint: Callable[..., Path], arch: str, fmt: str, tmp: Path, **overrides: Any
) -> Path:
    """A checkpoint whose embedding is exactly representable in `fmt` (a GGUF's quantized token_embd is looked up
    dequantized; our int8/int4 path looks the float one up): then both paths hold the very same numbers."""
    from safetensors.torch import load_file, save_file

    src = make_checkpoint(arch, **{**SPREAD, **overrides})
    out = tmp / f"{arch}-{fmt}"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    emb = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = formats.unpack(formats.pack(emb, fmt)).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("fmt,quantization", [("q8_0", "int8"), ("q4_0", "int4")])
@pytest.mark.parametrize("arch", ["qwen2", "phi3"])  # phi3: q|k|v and gate|up arrive fused, as one block weight
def test_quantized_gguf_loads_its_blocks_unchanged(
    make_checkpoint: Callable[..., Path], tmp_path: Path, arch: str, fmt: str, quantization: str
) -> None:
    ckpt = _quantized_checkpoint(make_checkpoint, arch, fmt, tmp_path)
    path = export_gguf(ckpt, tmp_path / f"m-{fmt}.gguf", fmt)
    gg = LLM(str(path), dtype="float32")
    ours = LLM(str(ckpt), dtype="float32", quantization=quantization)
    assert gg.loaded.kernels == ours.loaded.kernels == {fmt: 2 * 4 + 1}  # qkv, o, gate_up, down per layer; head
    for (name, a), (_, b) in zip(_kernel_linears(gg), _kernel_linears(ours), strict=True):
        assert torch.equal(a.data, b.data), name  # the same bytes: loaded as blocks, never re-quantized
    ids = ours.loaded.tokenizer.encode(PROMPTS[0])
    assert torch.equal(_logits(gg, ids), _logits(ours, ids))
    assert _greedy(gg, PROMPTS) == _greedy(ours, PROMPTS)
    with pytest.raises(ValueError, match="already holds"):
        LLM(str(path), quantization="int4" if fmt == "q8_0" else "int8")


def _kernel_linears(llm: LLM) -> list[tuple[str, KernelLinear]]:
    return [(n, m) for n, m in llm.loaded.model.named_modules() if isinstance(m, KernelLinear)]


def test_mixed_shards_of_one_fused_weight_load_dense(exported: Callable[..., Any], tmp_path: Path) -> None:
    ckpt, _ = exported("qwen2")
    path = export_gguf(ckpt, tmp_path / "mixed.gguf", "q8_0", overrides={"blk.0.attn_k.weight": "f32"})
    gg = LLM(str(path), dtype="float32")
    layer = gg.loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, KernelLinear) and layer.format == "f32"  # q, v in blocks + k in floats: all floats
    assert gg.loaded.model.model.layers[1].self_attn.qkv_proj.format == "q8_0"
    assert len(_greedy(gg, PROMPTS[:1])[0]) == GREEDY.max_tokens


def test_tokenizer_chat_template_and_special_tokens(exported: Callable[..., Any]) -> None:
    ckpt, path = exported("qwen2")
    hf, gg = LLM(str(ckpt), dtype="float32"), LLM(str(path))
    for text in PROMPTS + ["Ünïcödé: café, 日本語 🙂"]:
        assert gg.loaded.tokenizer.encode(text) == hf.loaded.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hello"}]
    assert gg.loaded.tokenizer.apply_chat_template(messages) == hf.loaded.tokenizer.apply_chat_template(messages)
    assert gg.loaded.tokenizer.eos_token_id == hf.loaded.tokenizer.eos_token_id


@pytest.mark.parametrize("case", list(CASES))
def test_the_tokenizer_class_named_by_the_model_type_tokenizes_as_transformers_own_choice(
    exported: Callable[..., Any], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader names the tokenizer class by the file's model type, so transformers need not read the file's
    metadata a second time to learn it; built both ways (no cache), the two tokenize and template alike. (The path of
    files whose tokenizer gguf_bpe does not build: it is made to build none here.)"""
    from tokenmill.tokenizer import gguf_bpe
    from tokenmill.weights.gguf_checkpoint import GGUFCheckpoint

    monkeypatch.setattr(gguf_bpe, "build", lambda _: None)
    path = exported(case)[1]
    built = []
    for i, model_type in enumerate((GGUFCheckpoint(path).hf_config()["model_type"], None)):
        monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / str(i)))  # each built afresh
        built.append(Tokenizer(path, model_type))
    named, chosen = built  # first builds: transformers' tokenizers
    assert type(named.backend.hf) is type(chosen.backend.hf) and named.vocab_size == chosen.vocab_size
    for text in [*PROMPTS, "Ünïcödé: café, 日本語 🙂", "  two spaces\n\tand a tab"]:
        assert named.encode(text) == chosen.encode(text)
    assert named.eos_token_id == chosen.eos_token_id and named.chat_template_text == chosen.chat_template_text


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    """Write what `writer` holds (header, keys, tensors) to `path`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_gguf(path: Path, arch: str, tensor_type: str = "F32") -> Path:
    """A minimal GGUF: `arch`, one 32x32 tensor stored as `tensor_type` (a block type gets zero bytes)."""
    import numpy as np

    writer = gguf.GGUFWriter(path, arch)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((32, 32), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor("token_embd.weight", np.zeros((32, 32 // block * size), dtype=np.uint8), raw_dtype=qtype)
    return _finish(writer, path)


def test_bad_files_are_one_clear_error(exported: Callable[..., Any], tmp_path: Path) -> None:
    from tokenmill.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"architecture 'mamba' .* supported: llama, qwen2, qwen3, gpt2"):
        LLM(str(_write_gguf(tmp_path / "mamba.gguf", "mamba")))
    with pytest.raises(ModelLoadError, match=r"token_embd.weight is IQ2_XXS, .* supported: F32, F16, BF16, Q8_0"):
        LLM(str(_write_gguf(tmp_path / "iq.gguf", "llama", "IQ2_XXS")))
    _, good = exported("llama")
    data = good.read_bytes()
    for name, cut in [("header.gguf", data[:200]), ("tensors.gguf", data[: len(data) - 1000])]:
        (tmp_path / name).write_bytes(cut)
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            LLM(str(tmp_path / name))


def _phi3_gguf(path: Path, rotated: int = 16, factors: dict[str, int] | None = None) -> Path:
    """A phi3 file's metadata (head_dim 16) and embedding, RoPE over `rotated` dimensions, and `rope_factors_{k}`
    tensors of n values for `factors` {k: n}: enough for the config, where such variants are refused."""
    import numpy as np

    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_context_length(512)
    writer.add_rope_scaling_orig_ctx_len(64)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(rotated)
    writer.add_tensor("token_embd.weight", np.zeros((384, 64), dtype=np.float32))
    for kind, n in (factors or {}).items():
        writer.add_tensor(f"rope_factors_{kind}.weight", np.ones(n, dtype=np.float32))
    return _finish(writer, path)


@pytest.mark.parametrize(
    "variant, message",
    [
        (dict(rotated=12), r"RoPE over 12 of each head's 16 dimensions .*; supported: RoPE over the whole head"),
        (dict(factors={"long": 8}), r"LongRoPE with only one of its factor tensors .*; supported: rope_factors_long"),
        (dict(factors={"long": 8, "short": 7}), r"rope_factors_short.weight holds 7 values; head_dim 16 needs 8"),
    ],
)
def test_unsupported_phi3_variants_are_one_clear_error(tmp_path: Path, variant: dict[str, Any], message: str) -> None:
    from tokenmill.errors import ModelLoadError

    path = _phi3_gguf(tmp_path / "variant.gguf", **variant)
    with pytest.raises(ModelLoadError, match=message) as e:
        LLM(str(path))
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


U32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING


def _llama_meta_gguf(path: Path, embd: tuple[int, ...] = (384, 64), **keys: Any) -> Path:
    """A llama file's metadata (hidden 64, 4 heads) with `keys` (llama.*, a value or a (value, GGUF type) pair)
    put over it, and an embedding of numpy shape `embd`: enough for the config, where bad values are refused."""
    import numpy as np

    V = gguf.GGUFValueType
    meta: dict[str, Any] = {"context_length": (512, V.UINT32), "embedding_length": (64, V.UINT32),
                            "block_count": (2, V.UINT32), "feed_forward_length": (96, V.UINT32),
                            "attention.head_count": (4, V.UINT32), "attention.head_count_kv": (2, V.UINT32),
                            "attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
                            "rope.freq_base": (10000.0, V.FLOAT32), **keys}  # fmt: skip
    writer = gguf.GGUFWriter(path, "llama")
    for key, (value, kind) in meta.items():
        writer.add_key_value(f"llama.{key}", value, kind)
    writer.add_tensor("token_embd.weight", np.zeros(embd, dtype=np.float32))
    return _finish(writer, path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(**{"attention.head_count": (0, U32)}), r"llama.attention.head_count is 0; allowed"),
        (dict(**{"attention.head_count_kv": (0, U32)}), r"head_count_kv is 0; allowed an integer"),
        (dict(context_length=("abc", STR)), r"llama.context_length is 'abc'; allowed an integer"),
        (dict(**{"attention.layer_norm_rms_epsilon": ("x", STR)}), r"epsilon is 'x'; allowed a"),
        (dict(**{"rope.freq_base": (0.0, gguf.GGUFValueType.FLOAT32)}), r"llama.rope.freq_base is 0.0; allowed a"),
        (dict(embd=(64,)), r"token_embd.weight has shape \[64\]; allowed \[hidden, vocab\]"),
    ],
)  # fmt: skip
def test_bad_metadata_values_are_one_line_naming_the_key(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    """Counts of 0 (a division by zero's traceback before), a string for a number, a RoPE base of 0 (every logit
    NaN before, with no error) and an embedding of one dimension: one line naming the file and the key."""
    from tokenmill.errors import ModelLoadError

    path = _llama_meta_gguf(tmp_path / "meta.gguf", **change)
    with pytest.raises(ModelLoadError, match=message) as e:
        LLM(str(path))
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def _rewritten(good: Path, path: Path, **changes: Any) -> Path:
    """`good` copied with its tokenizer keys changed: tokenizer.ggml.KEY -> a value, a (value, type), or None (drop)."""
    import numpy as np

    reader = gguf.GGUFReader(good)
    writer = gguf.GGUFWriter(path, arch=str(reader.fields["general.architecture"].contents()))
    for name, kv in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, kind = kv.contents(), kv.types[0]
        sub = kv.types[1] if len(kv.types) > 1 else None
        key = name.removeprefix("tokenizer.ggml.")
        if key in changes:
            if changes[key] is None:
                continue
            value, kind = changes[key] if isinstance(changes[key], tuple) else (changes[key], kind)
        writer.add_key_value(name, value, kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_shape=tuple(int(x) for x in t.shape[::-1]),
                          raw_dtype=t.tensor_type)  # fmt: skip
    return _finish(writer, path)


def test_tokenizer_lists_that_disagree_are_one_line(exported: Callable[..., Any], tmp_path: Path) -> None:
    """A token_type or tokens list of another length than the vocabulary's (control tokens read as text before, or
    ids past the embedding), a special id outside it, a tokenizer model the loaders lack, or BPE without merges: one
    line naming the key, before any tokenizer is built."""
    from tokenmill.errors import ModelLoadError

    _, good = exported("llama")
    reader = gguf.GGUFReader(good)
    types, tokens = reader.fields["tokenizer.ggml.token_type"].contents(), reader.fields["tokenizer.ggml.tokens"]
    rows = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")  # ggml order: [hidden, vocab]
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(token_type=types[:-5]), rf"token_type holds {len(types) - 5} entries for the {len(types)} tokens"),
        (dict(eos_token_id=10**6), r"tokenizer.ggml.eos_token_id is 1000000; allowed an id in \[0, "),
        (dict(model="t5"), r"tokenizer.ggml.model is 't5'; supported: gpt2 \(byte-level BPE\), llama"),
        (dict(merges=None), r"a byte-level BPE tokenizer needs tokenizer.ggml.merges"),
        (
            dict(tokens=tokens.contents() + [f"extra{i}" for i in range(1000)], token_type=types + [1] * 1000),
            rf"{len(types) + 1000} tokens \(tokenizer.ggml.tokens\) for {rows} rows of token_embd.weight",
        ),
    ]
    for i, (change, message) in enumerate(cases):
        path = _rewritten(good, tmp_path / f"bad{i}.gguf", **change)
        with pytest.raises(ModelLoadError, match=message) as e:
            LLM(str(path))
        assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_cli_reports_a_bad_gguf_in_one_line(exported: Callable[..., Any], tmp_path: Path) -> None:
    from tests.unit.test_cli import assert_one_line_error, run_cli

    _, good = exported("llama")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:-1000])
    assert_one_line_error(run_cli("generate", str(tmp_path / "cut.gguf"), "--prompt", "x"), "truncated or corrupt")
    assert_one_line_error(run_cli("generate", str(tmp_path / "none.gguf"), "--prompt", "x"), "does not exist")


def test_a_file_larger_than_memory_fails_in_one_line_before_loading(
    exported: Callable[..., Any], tmp_path: Path
) -> None:
    """The tiny model's file, with one more tensor declared as large as the machine's memory and a GiB: a sparse
    file, so nothing that large is written or read."""
    import gguf

    from tests.unit.test_cli import assert_one_line_error, run_cli
    from tokenmill.memory import machine_bytes

    have = machine_bytes()
    if have is None:
        pytest.skip("this platform tells no memory size (sysconf), so there is no limit to exceed")
    _, good = exported("llama")
    reader = gguf.GGUFReader(good)
    big = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(big, arch="llama")
    for name, kv in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = kv.types[1] if len(kv.types) > 1 else None
            writer.add_key_value(name, kv.contents(), kv.types[0], sub_type=sub)
    rows = (have + 2**30) // (4 * 4096) + 1
    for t in [*reader.tensors, None]:
        shape, nbytes = ((4096, rows), rows * 4096 * 4) if t is None else (tuple(t.shape), int(t.n_bytes))  # ggml order
        raw = gguf.GGMLQuantizationType.F32 if t is None else t.tensor_type
        writer.add_tensor_info("spare.weight" if t is None else t.name, shape[::-1],
                               np.dtype(np.float32), nbytes, raw_dtype=raw)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(big, "r+b") as f:
        f.truncate(f.seek(0, 2) + sum(int(t.n_bytes) for t in reader.tensors) + rows * 4096 * 4 + 2**20)
    result = run_cli("generate", str(big), "--prompt", "x")
    assert_one_line_error(result, "more than this machine's")
    assert "big.gguf" in result.stderr


@pytest.mark.parametrize("case", ["llama", "qwen2-tied", "gemma3", "phi3"])
def test_llamacpp_greedy_equals_ours_on_the_same_q8_0_file(exported: Callable[..., Any], case: str) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional llamacpp extra) is not installed")
    _, path = exported(case, "q8_0")
    _assert_llamacpp_top1(LLM(str(path), dtype="float32"), path)


def _assert_llamacpp_top1(ours: LLM, path: Path) -> None:
    """llama.cpp's greedy tokens on the very file we load are our top-1 too. llama.cpp runs in a child process,
    so that a native crash fails the test rather than pytest."""
    import json
    import subprocess
    import sys

    ids = ours.loaded.tokenizer.encode(PROMPTS[0])
    code = ("import json, sys; from tokenmill.bench.llamacpp_backend import run_llamacpp\n"
            "r = run_llamacpp(sys.argv[1], [json.loads(sys.argv[2])], int(sys.argv[3]), 1, 128, warmup=False)\n"
            "print(json.dumps(r['runs'][0]['token_ids']))\n")  # fmt: skip
    args = [sys.executable, "-c", code, str(path), json.dumps(ids), str(GREEDY.max_tokens)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    # teacher-forced on llama.cpp's tokens: each is our top-1 too, up to near-ties. llama.cpp keeps its KV cache in
    # f16 and sums in another order, so logits ~1% of their range apart may swap (measured: 0.016 of 3.5); a wrong
    # layout, permutation or scale moves them by the whole range
    logits = _logits(ours, ids + theirs)[len(ids) - 1 : -1]  # [n, V]: the logits each of its tokens came from
    chosen = logits.gather(1, torch.tensor(theirs)[:, None])[:, 0]
    gap = logits.max(dim=1).values - chosen  # 0 where its token is our argmax
    assert (gap <= 0.02 * logits.abs().max()).all(), (theirs, gap)
    assert (gap == 0).float().mean() >= 0.8  # and nearly always exactly ours


def _llama_quantize() -> str | None:
    import os
    import shutil

    return os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize")


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0", "Q4_0"])
def test_files_from_llama_quantize_load_what_they_hold(
    make_checkpoint: Callable[..., Path], tmp_path: Path, kind: str
) -> None:
    """A file as llama.cpp users have them: every linear holds exactly the file's values in its own kernel format
    (a qkv whose v is another type as one linear per shard), and where llama-cpp-python is installed, its greedy
    tokens are our top-1."""
    import subprocess

    exe = _llama_quantize()
    if exe is None:
        pytest.skip("llama.cpp's llama-quantize is not on PATH nor in $LLAMA_QUANTIZE (the optional llama.cpp peer)")
    # K-quants need rows of 256: a wider tiny model
    ckpt = make_checkpoint("llama", hidden_size=256, intermediate_size=512, **SPREAD)
    f32 = export_gguf(ckpt, tmp_path / "f32.gguf", "f32")
    out = tmp_path / f"{kind}.gguf"
    proc = subprocess.run([exe, str(f32), str(out), kind], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    gg = LLM(str(out), dtype="float32")
    types = {t.name: t for t in gguf.GGUFReader(out).tensors}
    layer = gg.loaded.model.model.layers[1]
    for gguf_name, module in [("blk.1.ffn_down.weight", layer.mlp.down_proj), ("blk.1.attn_v.weight", None)]:
        t = types[gguf_name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        qkv = layer.self_attn.qkv_proj
        if module is None and isinstance(qkv, SegmentedLinear):  # v in another type than q, k: its own linear
            got = formats.unpack(qkv.parts[-1].packed())
        elif module is None:  # v: the last rows of the fused qkv
            got = formats.unpack(qkv.packed())[-want.shape[0] :]
        else:
            got = formats.unpack(module.packed())
        assert torch.equal(got, want.view(got.shape)), (gguf_name, t.tensor_type.name)
    want_kernels = {"q4_k", "q6_k"} if kind == "Q4_K_M" else {kind.lower()}  # (Q4_0's output tensor is Q6_K)
    assert want_kernels <= set(gg.loaded.kernels), gg.loaded.kernels
    if importlib.util.find_spec("llama_cpp") is not None:
        _assert_llamacpp_top1(gg, out)


def test_a_tokenizer_that_adds_bos_keeps_adding_it(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A tokenizer whose post-processor prepends BOS (Llama's): the file says add_bos, and the tokenizer built
    from it prepends it too."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    ckpt = tmp_path / "bos"
    src = make_checkpoint("llama", **SPREAD)
    ckpt.mkdir()
    for f in src.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(str(src))
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)]
    )
    tok.save_pretrained(str(ckpt))
    hf = AutoTokenizer.from_pretrained(str(ckpt))
    assert hf.encode("Hello")[0] == bos  # the premise
    path = export_gguf(ckpt, tmp_path / "bos.gguf", "f32")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.add_bos_token"].contents() is True
    gg = LLM(str(path))
    for text in PROMPTS:
        assert gg.loaded.tokenizer.encode(text) == hf.encode(text)

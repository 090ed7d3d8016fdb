"""Hugging Face checkpoint -> GGUF, so the llama.cpp peer runs the very same weights as tokenmill.

Supports the families that name a GGUF arch (`ModelFamily.gguf_arch`: Llama and Mistral as `llama`, incl. llama3
and linear RoPE scaling; Qwen2 as `qwen2`; Qwen3 as `qwen3`; GPT-2; Gemma 3; Phi-3 as `phi3`, incl. LongRoPE).
Written with the `gguf` library after studying llama.cpp's `convert_hf_to_gguf.py`; what llama.cpp expects and
we reproduce:

- tensor names `token_embd`, `blk.N.attn_q`, ... (`gguf.TENSOR_NAMES`); 1-D tensors (norms, biases) stay F32;
  tied embeddings write no `output` tensor (llama.cpp then reuses `token_embd`).
- the `llama` arch computes RoPE on interleaved pairs (GPT-J style) where HF rotates the two halves of each head
  (NeoX style), so Q and K rows are permuted per head; the other archs use NeoX RoPE: no permutation.
- tokenizer (the one AutoTokenizer loads): byte-level BPE -> `tokenizer.ggml.model = "gpt2"` with tokens, token
  types and merges, and `tokenizer.ggml.pre` chosen from the pre-tokenizer's split regex so llama.cpp splits text
  as HF does; SentencePiece-style BPE with byte fallback (Llama 2) -> `"llama"` with scores from the merge ranks.

Mistral's window (v0.1: 4096) is written as `llama.attention.sliding_window`, which tokenmill's loader applies; a
llama.cpp build that does not read that key for the `llama` arch attends to the whole context, so its outputs
differ past the window. A Qwen2 window that is on is not carried over (a warning says so).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.kernels.formats import format_for
from tokenmill.kernels.kformats import KSPECS, encode_gguf_rows
from tokenmill.kernels.kquantize import quantize_k
from tokenmill.models import FAMILIES
from tokenmill.weights.gguf_names import hf_to_gguf

# the K family quantized by our own ggml-exact quantizers (kernels/kquantize.py); a K-quant's rows that are not
# whole superblocks take llama-quantize's fallback type (formats.format_for)
GGUF_DTYPES = ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1")
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0", "q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K",
               "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1", "q4_1": "MOSTLY_Q4_1"}  # fmt: skip
# GPT-2's own split (also what `ByteLevel(use_regex=True)` applies), and Llama 3's and Qwen2's (from tokenizer.json)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")  # single digits
_SPLIT_REGEX_TO_PRE = {_GPT2_REGEX: "gpt-2", _LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}


def export_gguf(
    hf_dir: Path, out_path: Path, dtype: str = "bf16", overrides: dict[str, str] | None = None, name: str | None = None
) -> Path:
    """Convert the HF checkpoint folder `hf_dir` to the GGUF file `out_path` with weights in `dtype`; `overrides`
    gives single tensors (by GGUF name) another type, as llama-quantize's `--tensor-type`."""
    import gguf

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r} is not supported; allowed: {', '.join(GGUF_DTYPES)}")
    for name, kind in (overrides or {}).items():
        if kind not in GGUF_DTYPES:
            raise ValueError(f"GGUF type {kind!r} for {name} is not supported; allowed: {', '.join(GGUF_DTYPES)}")
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} is not a Hugging Face checkpoint folder (no config.json)")
    config: dict[str, Any] = json.loads((hf_dir / "config.json").read_text())
    hf_arch = (config.get("architectures") or ["?"])[0]
    exportable = [a for f in FAMILIES if f.gguf_arch for a in f.architectures]
    family = next((f for f in FAMILIES if hf_arch in f.architectures), None)
    if family is None or family.gguf_arch is None:
        raise ValueError(f"cannot export architecture {hf_arch!r} to GGUF; supported: {', '.join(exportable)}")
    arch = gguf.MODEL_ARCH[family.gguf_arch]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_name(name or hf_dir.name)  # (llama.cpp reads it: a "phi3" name asks for Phi-3's special tokens)
        writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[dtype]])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        arch_name = gguf.MODEL_ARCH_NAMES[arch]
        rope_tensors: dict[str, npt.NDArray[np.float32]] = {}
        if arch_name == "gpt2":
            _write_gpt2_hparams(writer, config)
        elif arch_name == "gemma3":
            config = family.normalize_hf(config)  # the text config, RoPE flattened to the global layers'
            rope_tensors = _write_hparams(writer, config, arch_name, act="gelu_pytorch_tanh")  # GeGLU
            _write_gemma3_hparams(writer, config)
        elif arch_name == "phi3":
            rope_tensors = _write_phi3_hparams(writer, config)
        else:
            rope_tensors = _write_hparams(writer, config, arch_name)
        _write_vocab(writer, hf_dir, config)
        for name, data in _hf_tensors(hf_dir, config, arch_name, family):
            _add_tensor(writer, name, data, (overrides or {}).get(name, dtype))
        for name, factors in rope_tensors.items():
            writer.add_tensor(name, factors)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        out_path.unlink(missing_ok=True)
        raise
    writer.close()
    return out_path


def _write_hparams(
    writer: Any, config: dict[str, Any], arch: str, act: str = "silu"
) -> dict[str, npt.NDArray[np.float32]]:
    """Model hyperparameters; returns llama3's per-frequency RoPE factors (a `rope_freqs` tensor) if needed."""
    import gguf

    head_dim = _write_shape(writer, config)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    window = int(config.get("sliding_window") or 0)
    windowed = window and config.get("use_sliding_window", True) and window < config["max_position_embeddings"]
    if windowed and arch == "llama":  # Mistral: every layer (Gemma 3's windows: _write_gemma3_hparams)
        writer.add_sliding_window(window)
    elif windowed and arch != "gemma3":
        warnings.warn(f"sliding_window={window} is not exported: llama.cpp's {arch} arch attends to the whole "
                      "context", stacklevel=3)  # fmt: skip
    if config.get("hidden_act", act) != act:
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported by the GGUF export ({act} only)")
    rope, theta = _rope_parameters(config)
    writer.add_rope_freq_base(theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "llama3":
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        return {name: _llama3_rope_factors(rope, theta, head_dim)}
    elif rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} is not supported by the GGUF export (default, linear, llama3)")
    return {}


def _write_shape(writer: Any, config: dict[str, Any]) -> int:
    """What every Llama-shaped arch writes alike (context, widths, layers, heads, norm eps, vocabulary, RoPE over
    the whole head); returns head_dim."""
    n_head = config["num_attention_heads"]
    head_dim = int(config.get("head_dim") or config["hidden_size"] // n_head)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(config["vocab_size"])
    return head_dim


def _rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The RoPE fields and theta: transformers >= 5 keeps them in `rope_parameters`, 4.x in `rope_theta` /
    `rope_scaling`."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    return rope, float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _write_phi3_hparams(writer: Any, config: dict[str, Any]) -> dict[str, npt.NDArray[np.float32]]:
    """Phi-3's hyperparameters as llama.cpp's converter writes them (Phi3MiniModel): the original context, the
    window (0: none), and LongRoPE as two factor tensors with its cos/sin scale; returns those tensors."""
    import gguf

    max_pos = config["max_position_embeddings"]
    rope, theta = _rope_parameters(config)
    original = int(
        rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings", max_pos)
    )
    if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the GGUF export")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported by the GGUF export (silu only)")
    head_dim = _write_shape(writer, config)
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:  # (llama.cpp's default: hidden / heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_freq_base(theta)
    writer.add_sliding_window(int(config.get("sliding_window") or 0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return {}
    if rope_type != "longrope":
        raise ValueError(f"RoPE type {rope_type!r} is not supported by the Phi-3 GGUF export (default, longrope)")
    factor = float(rope.get("factor") or max_pos / original)  # HF's default scale, as the converter computes it
    scale = rope.get("attention_factor") or (math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1)
    writer.add_rope_scaling_attn_factors(float(scale))
    return {gguf.TENSOR_NAMES[t] + ".weight": np.asarray(rope[key], dtype=np.float32)
            for t, key in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
                           (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor"))}  # fmt: skip


def _write_gpt2_hparams(writer: Any, config: dict[str, Any]) -> None:
    """GPT-2's hyperparameters (its own config names), as llama.cpp's `gpt2` arch reads them."""
    n_embd = config["n_embd"]
    writer.add_context_length(config.get("n_positions", 1024))
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(config.get("n_inner") or 4 * n_embd)
    writer.add_block_count(config["n_layer"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config.get("layer_norm_epsilon", 1e-5))
    writer.add_vocab_size(config["vocab_size"])
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {config['activation_function']!r} is not supported by the GGUF export")


def _write_gemma3_hparams(writer: Any, config: dict[str, Any]) -> None:
    """Gemma 3's window and pattern; refuses what llama.cpp's `gemma3` arch fixes otherwise (the sliding layers'
    RoPE base 10000, scores scaled by head_dim ** -0.5, one global layer every `pattern`)."""
    from tokenmill.weights.gguf_checkpoint import GEMMA3_LOCAL_ROPE_BASE

    types = config["layer_types"]
    pattern = next((p for p in range(1, len(types) + 2)
                    if types == ["full_attention" if (i + 1) % p == 0 else "sliding_attention"
                                 for i in range(len(types))]), None)  # fmt: skip
    local = float(config["_rope_local"].get("rope_theta", 10000.0))
    scalar, head_dim = config.get("query_pre_attn_scalar") or config["head_dim"], config["head_dim"]
    problems = [what for what, bad in (
        ("layer_types with one global layer every N", pattern is None),
        (f"a sliding-layer RoPE base of {GEMMA3_LOCAL_ROPE_BASE:g} (not {local:g})", local != GEMMA3_LOCAL_ROPE_BASE),
        (f"query_pre_attn_scalar = head_dim = {head_dim} (not {scalar})", scalar != head_dim),
    ) if bad]  # fmt: skip
    if problems:
        raise ValueError(f"this Gemma 3 config has no llama.cpp equivalent; llama.cpp needs {'; '.join(problems)}")
    writer.add_sliding_window(int(config.get("sliding_window") or config["max_position_embeddings"]))
    writer.add_sliding_window_pattern(pattern)


def _llama3_rope_factors(rope: dict[str, Any], theta: float, head_dim: int) -> npt.NDArray[np.float32]:
    """Divisors of each inverse frequency, as transformers' llama3 RoPE applies them (llama.cpp: `rope_freqs`)."""
    factor, low, high = float(rope["factor"]), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _hf_tensors(hf_dir: Path, config: dict[str, Any], arch: str, family: Any) -> Iterator[tuple[str, Any]]:
    """(GGUF name, torch tensor) per weight: Q/K permuted for the `llama` arch, GPT-2's Conv1D weights turned
    to [out, in] as llama.cpp stores them."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(hf_dir.glob("model*.safetensors"))
    if not files:
        raise ValueError(f"{hf_dir} holds no model*.safetensors weights")
    n_head = int(config.get("num_attention_heads") or config.get("n_head") or 0)
    n_kv = int(config.get("num_key_value_heads") or n_head)
    tied = config.get("tie_word_embeddings", arch == "gpt2")
    skipped = ("rotary_emb.inv_freq", *family.model_class.hf_ignored)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for original in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                skipped_prefixes, renames = family.model_class.hf_skipped_prefixes, family.model_class.hf_renames
                if skipped_prefixes and original.startswith(skipped_prefixes):
                    continue  # a multimodal checkpoint's vision tower
                hf_name = next(
                    (new + original[len(old) :] for old, new in renames if original.startswith(old)), original
                )
                if hf_name.endswith(skipped) or (tied and hf_name == "lm_head.weight"):
                    continue
                name = hf_to_gguf(arch, hf_name)
                if name is None:
                    raise ValueError(f"unexpected tensor {hf_name!r} in {file.name}")
                data = f.get_tensor(original)
                if hf_name.endswith(family.model_class.hf_transposed):
                    data = data.t().contiguous()
                if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp multiplies by w, Gemma by 1 + w
                    data = data.float() + 1.0
                if family.gguf_permute_qk and name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight",
                                                              "attn_k.bias")):  # fmt: skip
                    data = _permute(data, n_head if ".attn_q." in name else n_kv)
                yield name, data


def _permute(w: Any, n_head: int) -> Any:
    """Per head, reorder rows [x0..x(d/2-1), y0..y(d/2-1)] (HF halves) into [x0, y0, x1, y1, ...] (pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tensor(writer: Any, name: str, data: Any, dtype: str) -> None:
    import gguf
    import torch

    if data.ndim <= 1 or dtype == "f32":
        writer.add_tensor(name, data.to(torch.float32).numpy())
    elif dtype == "bf16":
        bits = data.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif dtype in KSPECS and data.shape[-1] % 32 == 0:
        fmt = format_for(dtype, data.shape[-1])
        qtype = gguf.GGMLQuantizationType[fmt.upper()]
        raw = gguf.quants.quantize(data.float().numpy(), qtype) if fmt == "q8_0" else None
        if raw is None:
            raw = encode_gguf_rows(quantize_k(data.float().reshape(-1, data.shape[-1]), fmt)).numpy()
        writer.add_tensor(name, raw.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    elif dtype in ("q8_0", "q4_0") and data.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType[dtype.upper()]
        writer.add_tensor(name, gguf.quants.quantize(data.to(torch.float32).numpy(), qtype), raw_dtype=qtype)
    else:  # f16, and the fallback for rows that are not whole blocks (as convert_hf_to_gguf.py does)
        writer.add_tensor(name, data.to(torch.float16).numpy())


def _write_vocab(writer: Any, hf_dir: Path, config: dict[str, Any]) -> None:
    """Tokens, types, merges or scores, special ids, as the tokenizer transformers loads (AutoTokenizer) has them.

    The effective tokenizer can differ from tokenizer.json: transformers 5 gives `model_type: qwen2` checkpoints
    Qwen2's split regex and NFC whatever tokenizer.json says, and tokenmill tokenizes through AutoTokenizer too.
    """
    import gguf
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer of {hf_dir}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{hf_dir} has no fast (tokenizers) tokenizer, which the GGUF export reads")
    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r} is not supported by the GGUF export (BPE only)")
    n_vocab = config["vocab_size"]
    vocab: dict[str, int] = tok.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise ValueError(f"the tokenizer has ids up to {max(vocab.values())} but vocab_size is {n_vocab}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    added = {t["id"] for t in spec.get("added_tokens", [])}
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    normal = gguf.TokenType.NORMAL
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.USER_DEFINED if i in added else normal
    if model.get("byte_fallback"):  # SentencePiece-style BPE (Llama 2): llama.cpp's SPM tokenizer merges by score
        pre = spec.get("pre_tokenizer") or {}
        if pre.get("type") != "Metaspace":
            raise ValueError("unsupported SentencePiece-style tokenizer (expected a Metaspace pre-tokenizer)")
        for i, text in enumerate(tokens):
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[i] = gguf.TokenType.BYTE
        if tok.unk_token_id is not None:
            types[tok.unk_token_id] = gguf.TokenType.UNKNOWN
        # a merge's result scores -rank (earlier merges win, as in HF); unmergeable multi-char tokens never win
        rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))}
        scores = [0.0 if types[i] != normal or len(t) == 1 else -float(rank.get(t, 1e9)) for i, t in enumerate(tokens)]
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(pre.get("prepend_scheme", "always") != "never")
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_bpe_pre_tokenizer(spec))
        writer.add_token_merges(merges)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _write_special_tokens(writer, config, tok)


def _bpe_pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the byte-level BPE pre-tokenizer in tokenizer.json (how text is split before BPE)."""
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise ValueError(f"tokenizer normalizer {norm.get('type')!r} is not supported by the GGUF export")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regex = None
    for step in steps:
        if step.get("type") == "ByteLevel":
            if step.get("add_prefix_space"):
                raise ValueError("ByteLevel add_prefix_space=True has no llama.cpp equivalent")
            regex = _GPT2_REGEX if step.get("use_regex", True) and regex is None else regex
        elif step.get("type") == "Split" and regex is None and not step.get("invert"):
            regex = step.get("pattern", {}).get("Regex")
        else:
            raise ValueError(f"pre-tokenizer step {step.get('type')!r} is not supported by the GGUF export")
    if regex not in _SPLIT_REGEX_TO_PRE:
        raise ValueError(
            f"byte-level BPE split regex {regex!r} matches none that llama.cpp knows here "
            f"({', '.join(sorted(set(_SPLIT_REGEX_TO_PRE.values())))})"
        )
    return _SPLIT_REGEX_TO_PRE[regex]


def _write_special_tokens(writer: Any, config: dict[str, Any], tok: Any) -> None:
    """bos/eos/pad/unk ids (config.json's first, as generation uses them), whether HF adds BOS/EOS, chat template."""
    for kind, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):  # fmt: skip
        tid = config.get(f"{kind}_token_id")
        tid = tid[0] if isinstance(tid, list) and tid else tid
        tid = tid if isinstance(tid, int) else getattr(tok, f"{kind}_token_id", None)
        if isinstance(tid, int):
            add(tid)
    plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a", add_special_tokens=True)["input_ids"]
    writer.add_add_bos_token(len(full) > len(plain) and full[0] != plain[0])
    writer.add_add_eos_token(len(full) > len(plain) and full[-1] != plain[-1])
    if isinstance(tok.chat_template, str):
        writer.add_chat_template(tok.chat_template)

"""Hugging Face checkpoint -> GGUF, so the llama.cpp peer runs the very same weights as tokenmill.

Supports the families that name a GGUF arch (`ModelFamily.gguf_arch`: Llama and Mistral as `llama`, incl. llama3
and linear RoPE scaling; Qwen2 as `qwen2`; Qwen3 as `qwen3`; GPT-2; Gemma 3; Phi-3 as `phi3`, incl. LongRoPE;
Qwen3-MoE as `qwen3moe` and Mixtral as `llama` with experts).
Written with the `gguf` library after studying llama.cpp's `convert_hf_to_gguf.py`; what llama.cpp expects and
we reproduce:

- tensor names `token_embd`, `blk.N.attn_q`, ... (`gguf.TENSOR_NAMES`); 1-D tensors (norms, biases) stay F32;
  tied embeddings write no `output` tensor (llama.cpp then reuses `token_embd`).
- the `llama` arch computes RoPE on interleaved pairs (GPT-J style) where HF rotates the two halves of each head
  (NeoX style), so Q and K rows are permuted per head; the other archs use NeoX RoPE: no permutation.
- a MoE layer's experts are stacked into one [E, rows, cols] tensor per projection (`blk.N.ffn_gate_exps`, ...),
  and its router (`ffn_gate_inp`) stays F32, as llama.cpp keeps it. llama.cpp's qwen3moe renormalises the top-k
  weights and puts experts in every layer, so a config that differs is refused.
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.assembly.task import sentence_transformers_pooling
from tokenmill.bench.gguf_vocab import write_vocab
from tokenmill.kernels.formats import format_for
from tokenmill.kernels.kformats import KSPECS, encode_gguf_rows
from tokenmill.kernels.kquantize import quantize_k
from tokenmill.models import FAMILIES
from tokenmill.weights.gguf_names import gguf_experts_name, hf_expert, hf_to_gguf

# the K family quantized by our own ggml-exact quantizers (kernels/kquantize.py); a K-quant's rows that are not
# whole superblocks take llama-quantize's fallback type (formats.format_for)
GGUF_DTYPES = ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1")
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0", "q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K",
               "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1", "q4_1": "MOSTLY_Q4_1"}  # fmt: skip


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
    with gguf_file(out_path, gguf.MODEL_ARCH_NAMES[arch]) as writer:
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
            _write_moe_hparams(writer, family.config_from_hf(config).moe, arch_name)
        write_vocab(writer, hf_dir, config)
        pooling = sentence_transformers_pooling(hf_dir)  # an embedding model's, as llama.cpp's converter writes it
        if pooling is not None:
            writer.add_pooling_type(gguf.PoolingType.MEAN if pooling == "mean" else gguf.PoolingType.LAST)
        for name, data in _hf_tensors(hf_dir, config, arch_name, family):
            _add_tensor(writer, name, data, (overrides or {}).get(name, dtype))
        for name, factors in rope_tensors.items():
            writer.add_tensor(name, factors)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out_path


@contextmanager
def gguf_file(path: Path, arch: str) -> Iterator[Any]:
    """A GGUFWriter of `arch` writing `path`, closed at the end; a failure removes the half-written file."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    try:
        yield writer
    except BaseException:
        writer.close()
        path.unlink(missing_ok=True)
        raise
    writer.close()


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


def _write_moe_hparams(writer: Any, moe: Any, arch: str) -> None:
    """A mixture of experts' counts and width (nothing for a dense model), as llama.cpp's `arch` runs them."""
    if moe is None:
        return
    if arch == "qwen3moe" and not (moe.norm_topk_prob and all(moe.sparse_layers)):
        raise ValueError("llama.cpp's qwen3moe renormalises the top-k weights (norm_topk_prob) and has experts in "
                         "every layer (no mlp_only_layers, decoder_sparse_step 1): this config differs")  # fmt: skip
    if arch == "llama" and not all(moe.sparse_layers):
        raise ValueError("llama.cpp's llama arch with experts (Mixtral) has them in every layer")
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(moe.intermediate_size)


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
    import torch
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
    experts: dict[tuple[int, str], dict[int, Any]] = {}  # (layer, projection) -> the experts' weights so far
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for original in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                skipped_prefixes, renames = family.model_class.hf_skipped_prefixes, family.model_class.hf_renames
                if skipped_prefixes and original.startswith(skipped_prefixes):
                    continue  # a multimodal checkpoint's vision tower
                hf_name = next(
                    (new + original[len(old) :] for old, new in renames if original.startswith(old)), original
                )
                for part, ours in family.model_class.hf_part_renames:
                    hf_name = hf_name.replace(f".{part}.", f".{ours}.")
                if hf_name.endswith(skipped) or (tied and hf_name == "lm_head.weight"):
                    continue
                if (expert := hf_expert(hf_name)) is not None:  # stacked once the layer's last expert is in
                    layer, proj, which = expert
                    held = experts.setdefault((layer, proj), {})
                    held[which] = f.get_tensor(original)
                    if len(held) == num_experts:
                        yield gguf_experts_name(layer, proj), torch.stack([held.pop(e) for e in range(num_experts)])
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
    if name.endswith(".ffn_gate_inp.weight"):  # (a MoE router stays F32)
        dtype = "f32"
    values, qtype = encode(data, dtype)
    writer.add_tensor(name, values, raw_dtype=qtype)


def encode(data: Any, dtype: str) -> tuple[npt.NDArray[Any], Any]:
    """A float tensor as the GGUF stores it in `dtype`: (its values, uint8 blocks for a block type, and the ggml
    type; None for plain float32/float16 numpy arrays). 1-D tensors stay F32; rows that are not whole blocks fall
    back as llama-quantize's do (F16 for the legacy types, `format_for` for the K family)."""
    import gguf
    import torch

    if data.ndim <= 1 or dtype == "f32":
        return data.to(torch.float32).numpy(), None
    if dtype == "bf16":
        return data.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    if dtype == "mxfp4" and data.shape[-1] % 32 == 0:  # (gpt-oss's experts)
        qtype = gguf.GGMLQuantizationType.MXFP4
        return gguf.quants.quantize(data.to(torch.float32).numpy(), qtype), qtype
    if dtype in KSPECS and data.shape[-1] % 32 == 0:
        fmt = format_for(dtype, data.shape[-1])
        qtype = gguf.GGMLQuantizationType[fmt.upper()]
        raw = gguf.quants.quantize(data.float().numpy(), qtype) if fmt == "q8_0" else None
        if raw is None:
            raw = encode_gguf_rows(quantize_k(data.float().reshape(-1, data.shape[-1]), fmt)).numpy()
        return raw.reshape(*data.shape[:-1], -1), qtype
    if dtype in ("q8_0", "q4_0") and data.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType[dtype.upper()]
        return gguf.quants.quantize(data.to(torch.float32).numpy(), qtype), qtype
    return data.to(torch.float16).numpy(), None  # f16, and the fallback for rows that are not whole blocks

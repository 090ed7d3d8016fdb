"""A GGUF of random weights at a real model's shape, written straight to the file (`tokenmill make-model ... --gguf
TYPE`): no checkpoint and no float copy of the weights, in memory or on disk, so a 30B MoE's Q4_K_M (~18 GB) is
written on a laptop. The writer streams: the header and every tensor's info first, then each tensor's bytes as it
is made (the largest, one layer's experts of one projection, is the most it holds).

The weights are random but valid: each quantized tensor's rows are drawn from a pool of rows quantized once by our
ggml-exact quantizers (bench/gguf_export.py's `encode`) from N(0, 0.02) floats, so its blocks hold sane scales and
values; routers, norms and the like are floats, and llama3's RoPE factors (`rope_freqs`) what the config says. The
tensor types follow llama-quantize's recipes (`--gguf q4_k_m`: Q4_K, with Q6_K for the LM head (a tied embedding) and
for attn_v and the down projections (the experts' too) in the layers `quant_mix.more_bits` picks: tensor for tensor
the types llama-quantize gives qwen3-moe-small).
Llama-shaped families (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral: Q/K rows are random, so no permutation
applies) and gpt-oss (bench/gguf_random_oss.py; `--gguf mxfp4`: its experts in MXFP4, the rest Q8_0).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.bench.gguf_export import _write_hparams, _write_moe_hparams, encode, gguf_file
from tokenmill.bench.gguf_random_oss import gpt_oss_tensors, write_gpt_oss_hparams
from tokenmill.bench.gguf_vocab import write_vocab
from tokenmill.models import family_named
from tokenmill.models.quant_mix import MIXES, MORE, more_bits

GGUF_KINDS = ("f32", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m", "mxfp4")
_FILE_TYPES = {"f32": "ALL_F32", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0",
               "q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K", "q4_k_m": "MOSTLY_Q4_K_M",
               "q5_k_m": "MOSTLY_Q5_K_M", "mxfp4": "MOSTLY_MXFP4_MOE"}  # fmt: skip
LLAMA_SHAPED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
POOL_ROWS = 512  # rows quantized per (type, width); a tensor's rows are drawn from them
Spec = tuple[str, tuple[int, ...], str]  # (GGUF name, shape in torch order, our dtype name)


def write_random_gguf(arch: str, fields: dict[str, Any], tokenizer_dir: Path, out: Path, kind: str, seed: int) -> Path:
    """Write a GGUF of `arch` at `fields` (a make-model shape) with random weights of `kind` to `out`."""
    import gguf

    from tokenmill.make_model import hf_config

    if kind not in GGUF_KINDS:
        raise ValueError(f"--gguf {kind!r} is not supported; allowed: {', '.join(GGUF_KINDS)}")
    if arch not in (*LLAMA_SHAPED, "gpt_oss"):
        raise ValueError(f"--gguf writes Llama-shaped families ({', '.join(LLAMA_SHAPED)}) and gpt_oss, not {arch}")
    if kind == "mxfp4" and arch != "gpt_oss":
        raise ValueError("--gguf mxfp4 is gpt-oss's (its experts in MXFP4); other families: the K-quants")
    family = family_named(arch)
    config = hf_config(arch, **fields).to_dict()
    cfg = family.config_from_hf(config)
    if arch == "gpt_oss":
        arch_name, specs = "gpt-oss", list(gpt_oss_tensors(cfg, kind))
    else:
        assert family.gguf_arch is not None
        arch_name, specs = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[family.gguf_arch]], list(_tensors(cfg, kind))
    fixed: dict[str, npt.NDArray[np.float32]] = {}  # tensors of set values: llama3's RoPE factors (rope_freqs)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gguf_file(out, arch_name) as writer:
        writer.add_name(f"random {arch}")
        writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[kind]])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if arch == "gpt_oss":
            write_gpt_oss_hparams(writer, config)
        else:
            fixed = _write_hparams(writer, config, arch_name)
            _write_moe_hparams(writer, cfg.moe, arch_name)
        specs += [(name, factors.shape, "f32") for name, factors in fixed.items()]
        write_vocab(writer, tokenizer_dir, config)
        rng, pools = np.random.default_rng(seed), _Pools(seed)
        for name, shape, dtype in specs:  # each tensor's info first, its bytes later (streamed)
            sample, qtype = pools.rows(dtype, shape[-1]) if len(shape) > 1 else (np.zeros(1, np.float32), None)
            row_shape = (*shape[:-1], sample.shape[-1]) if len(shape) > 1 else shape
            nbytes = int(np.prod(row_shape)) * sample.dtype.itemsize
            writer.add_tensor_info(name, row_shape, sample.dtype, nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, dtype in specs:
            writer.write_tensor_data(fixed[name] if name in fixed else _values(name, shape, dtype, pools, rng))
    return out


def _tensors(cfg: Any, kind: str) -> Iterator[Spec]:
    """Every tensor of a Llama-shaped model (with experts where the config has them), with its type under `kind`."""
    d, q, kv, n = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_layers
    base = MIXES.get(kind, kind)

    def mixed(layer: int) -> str:  # attn_v and the down projections in the layers llama-quantize gives more bits
        return MORE if kind in MIXES and more_bits(layer, n) else base

    head = MORE if kind in MIXES else base  # the LM head: the embedding where tied, as llama-quantize has it
    yield "token_embd.weight", (cfg.vocab_size, d), head if cfg.tie_word_embeddings else base
    yield "output_norm.weight", (d,), "f32"
    if not cfg.tie_word_embeddings:
        yield "output.weight", (cfg.vocab_size, d), head
    for i in range(n):
        blk = f"blk.{i}."
        yield blk + "attn_norm.weight", (d,), "f32"
        yield blk + "attn_q.weight", (q, d), base
        yield blk + "attn_k.weight", (kv, d), base
        yield blk + "attn_v.weight", (kv, d), mixed(i)
        if cfg.attention_bias:
            yield from ((blk + f"attn_{p}.bias", (rows,), "f32") for p, rows in (("q", q), ("k", kv), ("v", kv)))
        yield blk + "attn_output.weight", (d, q), base
        if cfg.qk_norm:
            yield from ((blk + f"attn_{p}_norm.weight", (cfg.head_dim,), "f32") for p in ("q", "k"))
        yield blk + "ffn_norm.weight", (d,), "f32"
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            e, width = cfg.moe.num_experts, cfg.moe.intermediate_size
            yield blk + "ffn_gate_inp.weight", (e, d), "f32"
            yield blk + "ffn_gate_exps.weight", (e, width, d), base
            yield blk + "ffn_up_exps.weight", (e, width, d), base
            yield blk + "ffn_down_exps.weight", (e, d, width), mixed(i)
        else:
            yield blk + "ffn_gate.weight", (cfg.intermediate_size, d), base
            yield blk + "ffn_up.weight", (cfg.intermediate_size, d), base
            yield blk + "ffn_down.weight", (d, cfg.intermediate_size), mixed(i)


class _Pools:
    """Rows of random N(0, 0.02) weights as a type stores them, made once per (type, width)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.made: dict[tuple[str, int], tuple[npt.NDArray[Any], Any]] = {}

    def rows(self, dtype: str, width: int) -> tuple[npt.NDArray[Any], Any]:  # ([POOL_ROWS, row bytes or values], type)
        if (dtype, width) not in self.made:
            import torch

            g = torch.Generator().manual_seed(self.seed + width)
            self.made[dtype, width] = encode(torch.randn(POOL_ROWS, width, generator=g) * 0.02, dtype)
        return self.made[dtype, width]


def _values(name: str, shape: tuple[int, ...], dtype: str, pools: _Pools, rng: np.random.Generator) -> npt.NDArray[Any]:
    """One tensor's data: norms ones (llama.cpp multiplies by them), other 1-D tensors and routers small floats,
    the rest rows drawn from the pool."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if len(shape) == 1 or name.endswith(".ffn_gate_inp.weight"):
        return rng.normal(0, 0.02, shape).astype(np.float32)
    pool, _ = pools.rows(dtype, shape[-1])
    picks = rng.integers(0, POOL_ROWS, int(np.prod(shape[:-1])))
    return pool[picks].reshape(*shape[:-1], pool.shape[-1])

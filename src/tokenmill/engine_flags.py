"""The engine's flags: one dashed flag per `EngineConfig` field, typed and defaulted from the dataclass itself, with
its one line of help (`generate`, `serve` and `bench` share them; cli.py)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from tokenmill.config import (
    BATCHING_MODES,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_MODES,
    QUANTIZATION_MODES,
    SCHEDULING_POLICIES,
    EngineConfig,
)

_CHOICES = {"dtype": DTYPES, "kv_cache": KV_CACHE_MODES, "kv_cache_dtype": KV_CACHE_DTYPES, "batching": BATCHING_MODES,
            "scheduling_policy": SCHEDULING_POLICIES, "quantization": QUANTIZATION_MODES,
            "speculative_model_quantization": QUANTIZATION_MODES}  # fmt: skip


# one line per engine flag; `--help` adds the default
HELP = {
    "task": "what the model serves: auto (what the checkpoint says: a *ForSequenceClassification scores, a bare "
    "decoder or a sentence-transformers folder embeds, else generate), generate, embed, score (rerank: the same), or "
    "generate,embed / generate,score for both from one causal LM",
    "dtype": "weights and activations: auto (the checkpoint's), float32, bfloat16, float16",
    "device": "auto (cuda when there is one), cpu, cuda or cuda:N",
    "kv_cache": "paged (blocks, prefix caching), contiguous (one buffer per sequence) or none (recompute)",
    "kv_cache_dtype": "what the paged KV pool holds: auto (the model's dtype), bfloat16, int8 or fp8 (each head's row "
    "of keys or values as int8, or float8 e4m3, with a bf16 scale, as llama.cpp's -ctk/-ctv q8_0: 1.9x the tokens in "
    "the same memory)",
    "max_model_len": "the longest sequence, prompt + output (default: the model's max_position_embeddings). On the "
    "CPU the default KV pool follows it, like llama-server's -c: room for --max-num-seqs sequences of this length; "
    "without it, the model's context, at least 32768 tokens (or --max-num-seqs full-length sequences if less), "
    "shared by the running sequences; at most min(25%% of free RAM, 4 GiB)",
    "revision": "hub revision (branch, tag or commit) of a hub model id",
    "max_num_seqs": "sequences that run in one step at most (with --max-model-len, the CPU's default KV pool holds "
    "this many at full length)",
    "max_num_batched_tokens": "tokens computed in one step at most (chunked prefill splits longer prompts)",
    "batching": "continuous (join and leave every step) or static (one batch at a time, the baseline)",
    "enable_chunked_prefill": "split long prompts across steps, beside running decodes",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before",
    "scheduling_policy": "fcfs (arrival order) or priority (the request's priority, then arrival)",
    "pooling_share": "while streams decode, embedding and score prompts take at most this share of a decode step's "
    "time a step (each stream's TPOT within ~1 + share of its own); 0: no limit",
    "num_scheduler_steps": "decode steps in one call while few sequences run and none waits (1: off)",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV blocks in the pool (default: from --kv-cache-memory-gb; else on the CPU from --max-model-len "
    "x --max-num-seqs, see --max-model-len; on a GPU 80%% of its free memory)",
    "kv_cache_memory_gb": "memory for the KV pool in GB (default: see --num-kv-blocks)",
    "touch_kv_cache": "write the whole KV pool at start, so its memory is resident and known up front",
    "prefix_cache_ram_gb": "host RAM in GB for prefix-cache blocks the KV pool evicts, loaded back by a later prompt "
    "that starts alike instead of recomputed (0: off)",
    "prefix_cache_dir": "a folder for prefix-cache blocks evicted from RAM (or from the pool, without RAM), kept "
    "across restarts and keyed by model, dtype and KV layout",
    "prefix_cache_disk_gb": "disk in GB for --prefix-cache-dir; the least recently used blocks go first",
    "quantization": "weight-only, in ggml's block types, quantized as llama-quantize does: none, int8 (Q8_0), int4 "
    "(Q4_0), q4_k, q5_k, q6_k (rows not a multiple of 256 take Q5_0, Q5_1, Q8_0, as llama-quantize's), q5_0, q5_1, "
    "q4_1, q4_k_m, q5_k_m; fp8: float8 weights and activations on a GPU with FP8 tensor cores (Ada, Hopper)",
    "cpu_kernels": "tokenmill's own CPU kernels (compiled for this CPU on first use); off: pure torch",
    "weight_cache": "keep a GGUF's or a safetensors folder's weights as the CPU kernels read them in "
    "$TOKENMILL_CACHE_DIR/packed (about the packed weights' size on disk), so later starts map them instead of "
    "repacking",
    "gpu_kernels": "on a GPU, tokenmill's Triton kernels (paged attention, fused norms, int8); off: torch's ops",
    "batch_invariant": "every request's logits bit for bit the same alone or in any batch (CPU kernels; slower)",
    "pack_weights": "oneDNN-prepacked weights (needs native bf16 for bfloat16)",
    "compile": "torch.compile the model",
    "enforce_eager": "on a GPU, run decode steps eagerly instead of replaying CUDA graphs",
    "threads": "torch threads (default: torch's choice, usually one per core)",
    "tensor_parallel_size": "processes that split every layer (torch.distributed; under torchrun: its ranks)",
    "speculative_model": "drafts: ngram (prompt lookup), demo-draft, or a draft model folder / hub id / .gguf",
    "num_speculative_tokens": "drafts verified per step",
    "ngram_prompt_lookup_min": "shortest suffix prompt lookup matches",
    "ngram_prompt_lookup_max": "longest suffix prompt lookup matches",
    "speculative_disable_by_batch_size": "no drafts while more sequences than this run or wait",
    "speculative_model_quantization": "the draft model's weight-only quantization (as --quantization)",
    "enable_lora": "serve LoRA adapters: requests name one as their model; POST /v1/load_lora_adapter loads more",
    "lora_modules": "LoRA adapters served from the start, each NAME=PATH (a peft folder: adapter_config.json and "
    "adapter_model.safetensors); implies --enable-lora",
    "max_lora_rank": "the largest rank a LoRA adapter may have",
}
_NOT_FLAGS = ("model", "seed")  # MODEL is positional; `generate --seed` is the request's seed


def engine_args(p: argparse.ArgumentParser) -> None:
    """One dashed flag per `EngineConfig` field, typed and defaulted from the dataclass itself."""
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder or hub id (default: the demo model)")
    hints = get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name in _NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        helped = HELP[f.name] if f.default is None else f"{HELP[f.name]} (default: {f.default})"
        if f.name == "lora_modules":
            p.add_argument(flag, nargs="+", type=_lora_module, default=(), metavar="NAME=PATH", help=helped)
        elif hint is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helped)
        elif f.name in _CHOICES:
            p.add_argument(flag, choices=_CHOICES[f.name], default=f.default, help=helped)
        else:
            kind = next(t for t in (int, float, str) if t is hint or t in get_args(hint))
            p.add_argument(flag, type=kind, default=f.default, metavar=f.name.upper(), help=helped)


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    kwargs = {f.name: getattr(a, f.name) for f in fields(EngineConfig) if f.name not in _NOT_FLAGS}
    kwargs["lora_modules"] = tuple(kwargs["lora_modules"])
    return kwargs


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH, the folder checked here: a bad one stops the command before the model loads."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH (an adapter's name, then its peft folder)")
    folder = Path(path).expanduser()
    if not (folder / "adapter_config.json").is_file():
        what = "does not exist" if not folder.exists() else "holds no adapter_config.json"
        raise argparse.ArgumentTypeError(f"{name}={path}: {path} {what} (a peft adapter folder holds "
                                         "adapter_config.json and adapter_model.safetensors)")  # fmt: skip
    return name, path

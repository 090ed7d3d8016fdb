"""Frozen configuration: the engine's knobs (`EngineConfig`) and the names they allow. The model's shape is
model_config.py's. Nothing here touches devices or reads the environment.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
KVCacheMode = Literal["paged", "contiguous", "none"]
KVCacheDType = Literal["auto", "bfloat16", "int8", "fp8"]  # what the paged pool holds (attention/kv_quant.py)
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "int8", "fp8")
KV_CACHE_MODES: tuple[str, ...] = ("paged", "contiguous", "none")
# what a model serves (--task): generate, embed, score ("rerank" is its other name), or generation and one pooling
# task together ("generate,embed"); auto: what the checkpoint says (assembly/task.py)
TASKS: tuple[str, ...] = ("auto", "generate", "embed", "score", "rerank")


def parse_task(task: str) -> frozenset[str]:
    """`--task`'s value as the set of tasks it names ("rerank" read as "score"); ValueError for one that is not a
    task or a combination we serve."""
    names = [n.strip() for n in str(task).split(",")]
    bad = next((n for n in names if n not in TASKS), None)
    tasks = frozenset("score" if n == "rerank" else n for n in names)
    if bad is not None or ("auto" in tasks and len(tasks) > 1) or {"embed", "score"} <= tasks:
        raise ValueError(f"task={task!r} is invalid: allowed {', '.join(TASKS)}, or generate with one of embed, score "
                         "(generate,embed)")  # fmt: skip
    return tasks


Batching = Literal["continuous", "static"]
BATCHING_MODES: tuple[str, ...] = ("continuous", "static")
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")
Quantization = Literal["none", "int8", "int4", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1", "q4_k_m", "q5_k_m",
                       "fp8"]  # fmt: skip
# int8 / int4: ggml's Q8_0 / Q4_0 blocks; q4_k ... q4_1: ggml's types of those names (kernels/kformats.py);
# q4_k_m / q5_k_m: llama-quantize's mixes of them (models/quant_mix.py); fp8: float8 W8A8 on a GPU with FP8 tensor
# cores (models/gpu_linear.py)
QUANTIZATION_MODES: tuple[str, ...] = ("none", "int8", "int4", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1",
                                       "q4_k_m", "q5_k_m", "fp8")  # fmt: skip


# A step's tokens at most, by default (as llama.cpp's n_ubatch): a burst of prompts is prefilled over several steps,
# so the first ones answer sooner. 16 streams of 128-token prompts on a Zen 5 (AVX-512 BF16), against 2048: TTFT p50
# about halved; output tok/s +17% on a 0.5B Q4_K_M file, -6% on a 1.5B Q5_K_M one (docs/benchmarks.md).
STEP_TOKENS = 512


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Validated here so the CLI and the offline API share one set of messages.

    Every optimisation is a switch: `kv_cache`, `batching`, `enable_chunked_prefill`, `enable_prefix_caching`,
    `quantization` (weight-only), `cpu_kernels` (tokenmill's own CPU kernels), `gpu_kernels` (its Triton kernels
    on a GPU), `pack_weights` (oneDNN-packed CPU weights), `compile` (torch.compile), `enforce_eager` (no CUDA
    graphs), `batch_invariant` (the same logits alone or in any batch).
    """

    model: str | None = None
    task: str = "auto"  # see TASKS / parse_task
    dtype: DType = "auto"
    device: str = "auto"
    kv_cache: KVCacheMode = "paged"
    kv_cache_dtype: KVCacheDType = "auto"
    max_model_len: int | None = None
    seed: int = 0
    revision: str | None = None
    # scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = STEP_TOKENS
    batching: Batching = "continuous"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    # while generation streams decode, pooling prompts (embeddings, scores) take at most this share of a decode
    # step's time a step (pooling_share.py: each stream's TPOT within ~1 + share of its own, and 0.4 keeps it
    # under 1.5x with room for the estimate's lag); 0: no limit
    pooling_share: float = 0.4
    # decode steps taken in one call of the CPU decode stack while few sequences run, none waits and nothing but a
    # draw or the argmax reads each one's logits (scheduler.py); 1: one step a call
    num_scheduler_steps: int = 4
    # paged KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    touch_kv_cache: bool = False  # write the whole pool at start: its memory is resident, and known, up front
    # the prefix cache's tiers below the pool (kv_cache/tiers.py): cached blocks the pool evicts are kept in host RAM,
    # then on disk under `prefix_cache_dir` (kept across restarts), and loaded back by a later prompt that hits them
    prefix_cache_ram_gb: float = 0.0  # 0: no RAM tier
    prefix_cache_dir: str | None = None  # None: no disk tier
    prefix_cache_disk_gb: float = 10.0
    # kernels
    quantization: Quantization = "none"
    cpu_kernels: bool = True  # tokenmill's own CPU kernels for bf16 / int8 / int4 linears (kernels/)
    # a GGUF's (or a safetensors folder's) weights packed for the kernels once, then mapped (weights/packed_cache.py)
    weight_cache: bool = True
    gpu_kernels: bool = True  # on a GPU: the Triton kernels (kernels/cuda/) for attention, norms and int8 linears
    # every request's logits bit for bit the same alone or in any batch (CPU kernels; docs/architecture.md)
    batch_invariant: bool = False
    pack_weights: bool = False
    compile: bool = False
    enforce_eager: bool = False  # CUDA: no graphs; every decode step launches its kernels one by one
    threads: int | None = None
    # scale-out: ranks that split every layer (models/sharding.py); rank 0 is this process
    tensor_parallel_size: int = 1
    # speculative decoding (spec_decode/): "ngram" (prompt lookup), or a draft model with the same tokenizer (a
    # folder, hub id or .gguf; "demo-draft": the built-in demo model's); off when None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4  # drafts verified per step
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    # no drafts while more sequences than this run: verifying k drafts for many sequences makes a step
    # compute-bound (Zen 3, Qwen 0.5B shape, prompts without repeats: 0.97x at 4 streams, 0.91x at 16)
    speculative_disable_by_batch_size: int = 4
    # the draft model's weight-only quantization: the draft only proposes, so this changes speed and acceptance,
    # never the output
    speculative_model_quantization: Quantization = "none"
    # LoRA adapters (peft folders) beside the base weights (models/lora.py): loaded at start (name -> folder), and
    # at run time where `enable_lora` (implied by `lora_modules`); no adapter may have a rank above `max_lora_rank`
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 16

    @property
    def lora(self) -> bool:
        """Adapters are served: their projections are attached, and requests may name one."""
        return self.enable_lora or bool(self.lora_modules)

    def __post_init__(self) -> None:
        choices = {
            "dtype": DTYPES,
            "kv_cache": KV_CACHE_MODES,
            "kv_cache_dtype": KV_CACHE_DTYPES,
            "batching": BATCHING_MODES,
            "scheduling_policy": SCHEDULING_POLICIES,
            "quantization": QUANTIZATION_MODES,
            "speculative_model_quantization": QUANTIZATION_MODES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; allowed: {', '.join(allowed)}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} is not supported; allowed: auto, cpu, cuda, cuda:N")
        positive = (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_scheduler_steps",
            "block_size",
            "num_kv_blocks",
            "threads",
            "tensor_parallel_size",
            "max_lora_rank",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: allowed an integer >= 1")
        pool = [
            n
            for n in ("touch_kv_cache", "num_kv_blocks", "kv_cache_memory_gb")
            if getattr(self, n) not in (None, False)
        ]
        if pool and self.kv_cache != "paged":  # (the pool's size was ignored silently without one)
            raise ValueError(f"{', '.join(pool)} needs kv_cache='paged'; kv_cache={self.kv_cache!r} has no block pool")
        parse_task(self.task)
        self._check_speculation()
        self._check_parallel()
        self._check_batch_invariant()
        self._check_lora()
        # (a float flag's inf or nan passed every `>= 0` before and failed later with a traceback)
        if self.kv_cache_memory_gb is not None and not 0 < self.kv_cache_memory_gb < math.inf:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb!r} is invalid: allowed finite values > 0")
        if not 0 <= self.pooling_share < math.inf:
            raise ValueError(f"pooling_share={self.pooling_share!r} is invalid: allowed finite values >= 0 (0: no "
                             "limit)")  # fmt: skip
        if not 0 <= self.prefix_cache_ram_gb < math.inf:
            raise ValueError(f"prefix_cache_ram_gb={self.prefix_cache_ram_gb!r} is invalid: allowed finite values >= 0")
        if not 0 < self.prefix_cache_disk_gb < math.inf:
            raise ValueError(f"prefix_cache_disk_gb={self.prefix_cache_disk_gb!r} is invalid: allowed finite values "
                             "> 0")  # fmt: skip
        cpus = 4 * (os.cpu_count() or 1)
        if self.threads is not None and self.threads > cpus:  # (100000 threads: a segfault in torch's pool)
            raise ValueError(f"threads={self.threads} is invalid: allowed 1 to {cpus} (4 per logical CPU here)")

    def _check_batch_invariant(self) -> None:
        """The mode holds for the CPU kernels over the paged pool; the other paths' sums depend on the batch."""
        if not self.batch_invariant:
            return
        conflicts = [
            (f"device={self.device}", self.device.startswith("cuda")), ("cpu_kernels=False", not self.cpu_kernels),
            ("dtype=float16", self.dtype == "float16"), ("compile=True", self.compile),
            ("pack_weights=True", self.pack_weights), (f"kv_cache={self.kv_cache}", self.kv_cache != "paged"),
            (f"tensor_parallel_size={self.tensor_parallel_size}", self.tensor_parallel_size > 1),
        ]  # fmt: skip
        wrong = [name for name, bad in conflicts if bad]
        if wrong:
            raise ValueError(f"batch_invariant runs on the CPU kernels over the paged KV cache (bfloat16 or float32 "
                             f"weights, any quantization), not with {', '.join(wrong)}")  # fmt: skip

    def _check_lora(self) -> None:
        modules = self.lora_modules
        pairs = modules.items() if isinstance(modules, dict) else modules  # the offline API's {name: folder}, too
        object.__setattr__(self, "lora_modules", tuple((str(n), str(p)) for n, p in pairs))
        names = [name for name, _ in self.lora_modules]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"lora_modules names {dup!r} twice: each adapter needs its own name")
        if not self.lora:
            return
        conflicts = (("tensor_parallel_size > 1", self.tensor_parallel_size > 1),
                     ("batch_invariant", self.batch_invariant), ("compile", self.compile))  # fmt: skip
        clash = [name for name, bad in conflicts if bad]
        if clash:
            raise ValueError(f"LoRA adapters are not supported with {' or '.join(clash)}; drop one or the other")

    def _check_parallel(self) -> None:
        if self.tensor_parallel_size == 1:
            return
        clash = {"kv_cache": self.kv_cache != "paged", "speculative_model": self.speculative_model is not None,
                 "compile": self.compile, "task": bool(parse_task(self.task) & {"embed", "score"})}  # fmt: skip
        named = [k for k, v in clash.items() if v]
        if named:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} runs with kv_cache='paged', no "
                             f"speculative_model, no compile and task generate; drop {', '.join(named)}")  # fmt: skip

    def _check_speculation(self) -> None:
        for name in ("num_speculative_tokens", "ngram_prompt_lookup_min", "ngram_prompt_lookup_max",
                     "speculative_disable_by_batch_size"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: allowed an integer >= 1")
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(f"ngram_prompt_lookup_min={self.ngram_prompt_lookup_min} exceeds "
                             f"ngram_prompt_lookup_max={self.ngram_prompt_lookup_max}")  # fmt: skip
        if self.speculative_model is not None and self.kv_cache == "none":
            raise ValueError("speculative decoding needs a KV cache: use kv_cache paged or contiguous")

"""Frozen configuration: the model's shape normalised from a Hugging Face config, and the engine's knobs.

`ModelConfig.from_hf` accepts both the transformers v4 layout (`rope_theta` + `rope_scaling`, `torch_dtype`)
and the v5 layout (`rope_parameters`, `dtype`), so checkpoints from either era load the same way.
Nothing here touches devices or reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.errors import ConfigError

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
KVCacheMode = Literal["paged", "contiguous", "none"]
KVCacheDType = Literal["auto", "bfloat16", "int8", "fp8"]  # what the paged pool holds (attention/kv_quant.py)
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "int8", "fp8")
KV_CACHE_MODES: tuple[str, ...] = ("paged", "contiguous", "none")
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")
# the MLP activation; the GELUs are GPT-2's ("gelu_new", the tanh approximation) and the exact one
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `kind` is HF's `rope_type`, `params` its extra fields (factor, ...)."""

    theta: float = 10000.0
    kind: str = "default"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: each token's router picks `top_k` of `num_experts` gated MLPs (`intermediate_size` wide) and
    sums their outputs by its softmax weights (renormalised over the chosen ones where `norm_topk_prob`).
    `sparse_layers[i]`: layer i holds the experts (else a dense MLP of the model's `intermediate_size`).
    `weights_in_float32`: the routing weights scale each expert's output in float32 (Mixtral), rather than rounded
    to the model's dtype first (Qwen3-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    weights_in_float32: bool = False
    # gpt-oss: the experts' clamped SwiGLU, (alpha, limit): up * sigmoid-gated gate, each clamped to `limit` first
    clamped_swiglu: tuple[float, float] | None = None
    # gpt-oss: the router's top k logits, then their softmax in the model dtype (not the softmax's top k)
    softmax_after_top_k: bool = False

    def check(self, num_layers: int) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok={self.top_k} must be in [1, num_experts="
                              f"{self.num_experts}]")  # fmt: skip
        if self.intermediate_size < 1:
            raise ConfigError(f"config.json: moe_intermediate_size={self.intermediate_size} must be >= 1")
        if len(self.sparse_layers) != num_layers:
            raise ConfigError(f"config.json: {len(self.sparse_layers)} MoE layer flags for {num_layers} layers")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], num_layers: int, **overrides: Any) -> MoEConfig:
        """The MoE fields of a Qwen-MoE / Mixtral-style config.json: `num_experts` (or `num_local_experts`),
        `num_experts_per_tok`, `moe_intermediate_size` (else `intermediate_size`), `norm_topk_prob`, and which
        layers are sparse: every `decoder_sparse_step`-th one not in `mlp_only_layers`."""
        try:
            experts = int(hf.get("num_experts") or hf["num_local_experts"])
            step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
            fields: dict[str, Any] = dict(
                num_experts=experts,
                top_k=int(hf["num_experts_per_tok"]),
                intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing the required MoE field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has an invalid MoE value: {e}") from None
        return cls(**{**fields, **overrides})


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # the eps of every norm (GPT-2's LayerNorms too)
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # attention window (Mistral v0.1, Phi-3, Gemma 3), when it binds: a token sees the last `sliding_window`
    # positions (itself included), in every layer or, with `layer_types`, in the "sliding_attention" ones
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all alike
    rope_local: RopeConfig | None = None  # Gemma 3: the sliding layers' own RoPE
    query_pre_attn_scalar: float | None = None  # Gemma: attention scores scaled by this ** -0.5, not Dh ** -0.5
    moe: MoEConfig | None = None  # a mixture of experts in (some of) the layers' MLPs
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in the softmax's denominator

    def __post_init__(self) -> None:
        checks = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
        for name, value in checks.items():
            if value < 1:
                raise ConfigError(f"config.json: {name}={value} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.rope.kind not in ROPE_TYPES:
            raise ConfigError(
                f"config.json: rope type {self.rope.kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        factors = ("short_factor", "long_factor") if self.rope.kind == "longrope" else ()
        missing = [k for k in factors if k not in self.rope.params]
        if missing:
            raise ConfigError(f"config.json: longrope scaling needs {' and '.join(missing)} in rope_parameters")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"config.json: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if self.moe is not None:
            self.moe.check(self.num_layers)
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"config.json: hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )

    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window (None: the whole context)."""
        if self.sliding_window is None:
            return [None] * self.num_layers
        if not self.layer_types:
            return [self.sliding_window] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], default_architecture: str = "<missing>", **overrides: Any) -> ModelConfig:
        """Normalise a parsed `config.json` dict; `overrides` are a family's quirks (see models/family.py)."""
        archs = hf.get("architectures") or []
        try:
            hidden = int(hf["hidden_size"])
            num_heads = int(hf["num_attention_heads"])
            head_dim = hf.get("head_dim") or hidden // num_heads
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
            attention_bias = bool(hf.get("attention_bias", False))
            fields: dict[str, Any] = dict(
                architecture=archs[0] if archs else default_architecture,
                model_type=str(hf.get("model_type", "")),
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope=rope_from_hf(hf),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                o_proj_bias=attention_bias,
                mlp_bias=bool(hf.get("mlp_bias", False)),
                hidden_act=str(hf.get("hidden_act", "silu")),
                torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=_sliding_window(hf),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing the required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has an invalid value: {e}") from None
        return cls(**{**fields, **overrides})


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window, when it is on (Qwen2 configs carry one with `use_sliding_window: false`) and shorter than
    the context."""
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return None
    return int(window) if int(window) < int(hf.get("max_position_embeddings", 2048)) else None


def rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Merge v5 `rope_parameters` and v4 `rope_theta`/`rope_scaling` into one RopeConfig."""
    params: dict[str, Any] = {}
    v5 = hf.get("rope_parameters")
    if isinstance(v5, dict):
        params.update(v5)
    v4 = hf.get("rope_scaling")
    if isinstance(v4, dict):
        params.update(v4)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = str(params.pop("rope_type", params.pop("type", "default")))
    if kind in ("yarn", "longrope"):
        original = hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
        params.setdefault("original_max_position_embeddings", original)
    if kind == "longrope":  # Phi-3: the default factor is the ratio of the two context lengths
        params.setdefault("max_position_embeddings", hf.get("max_position_embeddings", 2048))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("config.json: partial_rotary_factor != 1 is not supported")
    return RopeConfig(theta=theta, kind=kind, params=params)


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
Quantization = Literal["none", "int8", "int4", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1", "q4_k_m", "q5_k_m"]
# int8 / int4: ggml's Q8_0 / Q4_0 blocks; q4_k ... q4_1: ggml's types of those names (kernels/kformats.py);
# q4_k_m / q5_k_m: llama-quantize's mixes of them (models/quant_mix.py)
QUANTIZATION_MODES: tuple[str, ...] = ("none", "int8", "int4", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1",
                                       "q4_k_m", "q5_k_m")  # fmt: skip


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
    max_num_batched_tokens: int = 2048
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
        if self.touch_kv_cache and self.kv_cache != "paged":
            raise ValueError(f"touch_kv_cache needs kv_cache='paged'; kv_cache={self.kv_cache!r} has no pool to touch")
        parse_task(self.task)
        self._check_speculation()
        self._check_parallel()
        self._check_batch_invariant()
        self._check_lora()
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb!r} is invalid: allowed values > 0")
        if not self.pooling_share >= 0:
            raise ValueError(f"pooling_share={self.pooling_share!r} is invalid: allowed values >= 0 (0: no limit)")
        if not self.prefix_cache_ram_gb >= 0:
            raise ValueError(f"prefix_cache_ram_gb={self.prefix_cache_ram_gb!r} is invalid: allowed values >= 0")
        if not self.prefix_cache_disk_gb > 0:
            raise ValueError(f"prefix_cache_disk_gb={self.prefix_cache_disk_gb!r} is invalid: allowed values > 0")

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

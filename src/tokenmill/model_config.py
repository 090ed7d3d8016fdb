"""The model's shape, normalised from a Hugging Face config (or a GGUF's metadata put in its place): `ModelConfig`,
with its rotary embedding (`RopeConfig`) and experts (`MoEConfig`).

`ModelConfig.from_hf` accepts both the transformers v4 layout (`rope_theta` + `rope_scaling`, `torch_dtype`)
and the v5 layout (`rope_parameters`, `dtype`), so checkpoints from either era load the same way.
Nothing here touches devices or reads the environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ConfigError

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")
# the MLP activation; the GELUs are GPT-2's ("gelu_new", the tanh approximation) and the exact one
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `kind` is HF's `rope_type`, `params` its extra fields (factor, ...)."""

    theta: float = 10000.0
    kind: str = "default"
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def long_from(self) -> int | None:
        """LongRoPE's original context, from which positions rotate by the long factors; None for other kinds."""
        return int(self.params["original_max_position_embeddings"]) if self.kind == "longrope" else None


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
            "max_position_embeddings": self.max_position_embeddings,  # (0 failed every request, not the load)
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
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not 0 < theta < math.inf:
        raise ConfigError(f"rope_theta={theta!r} is invalid: allowed a finite number > 0 (0 made every "
                          "logit NaN)")  # fmt: skip
    theta = float(theta)
    kind = str(params.pop("rope_type", params.pop("type", "default")))
    if kind in ("yarn", "longrope"):
        original = hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
        params.setdefault("original_max_position_embeddings", original)
    if kind == "longrope":  # Phi-3: the default factor is the ratio of the two context lengths
        params.setdefault("max_position_embeddings", hf.get("max_position_embeddings", 2048))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("config.json: partial_rotary_factor != 1 is not supported")
    return RopeConfig(theta=theta, kind=kind, params=params)

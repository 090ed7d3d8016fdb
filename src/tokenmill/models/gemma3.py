"""Gemma 3, text only (`Gemma3ForCausalLM`, and the text tower of `Gemma3ForConditionalGeneration` checkpoints).

Where it differs from the Llama-shaped stack of layers.py (HF's modeling_gemma3, which the parity tests check):
- RMSNorm scales by (1 + w), computed in float32 (`GemmaRMSNorm`); q and k get one per head (q/k norm);
- four norms per layer: before and after attention, before and after the MLP (a "sandwich");
- GeGLU: the gated MLP with tanh-approximated GELU (`hidden_activation: gelu_pytorch_tanh`);
- token embeddings scaled by sqrt(hidden_size), in the model's dtype;
- attention scores scaled by `query_pre_attn_scalar ** -0.5` rather than head_dim ** -0.5;
- sliding-window layers interleaved with global ones (`layer_types`, or every `sliding_window_pattern`-th layer
  global), each kind with its own RoPE: the sliding ones `rope_local_base_freq` (v4 configs) or
  `rope_parameters["sliding_attention"]` (v5), the global ones the model's RoPE and its scaling.
Gemma 2's attention and final-logit soft-capping are not implemented: a config that sets them is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention import KVBackend
from tokenmill.errors import ConfigError
from tokenmill.model_config import ModelConfig, RopeConfig, rope_from_hf
from tokenmill.models.family import ModelFamily
from tokenmill.models.layers import Attention, CausalLM, GatedMLP, embedding
from tokenmill.models.rope import RotaryEmbedding, apply_rotary

SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32, cast back (HF's Gemma3RMSNorm); w starts at zero."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # type: ignore[assignment]
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # type: ignore[assignment]
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.q_scale = (scalar**-0.5) / (cfg.head_dim**-0.5)  # the backends scale by head_dim ** -0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVBackend, meta: Any
    ) -> torch.Tensor:  # [T, D] -> [T, D]
        q_norm, k_norm = self.q_norm, self.k_norm
        assert q_norm is not None and k_norm is not None
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q_norm(q.reshape(-1, self.num_heads, self.head_dim))  # [T, H, Dh]
        k = k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))  # [T, Hkv, Dh]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        kv.write(self.layer_idx, k, v, meta)
        o = kv.attend(self.layer_idx, q, k, v, meta)  # [T, H, Dh]
        return self.o_proj(o.reshape(-1, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.sliding = bool(cfg.layer_types) and cfg.layer_types[layer_idx] == SLIDING
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVBackend, meta: Any
    ) -> torch.Tensor:  # [T, D] -> [T, D]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    """Named like HF's `model.*` so weights map one to one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_scale = cfg.hidden_size**0.5
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.rotary_local = RotaryEmbedding(cfg.rope_local or cfg.rope, cfg.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVBackend, meta: Any) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, D]
        x = x * torch.tensor(self.embed_scale).to(x.dtype)  # HF multiplies by sqrt(D) rounded to the dtype
        rope = self.rotary(positions, x.dtype)  # ([T, Dh], [T, Dh])
        rope_local = self.rotary_local(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, *(rope_local if layer.sliding else rope), kv, meta)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    # multimodal checkpoints keep the text model under another prefix (v4: language_model.model., v5:
    # model.language_model.) next to the vision tower, which a text-only engine skips
    hf_renames = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))  # fmt: skip
    hf_skipped_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                           "model.multi_modal_projector.")  # fmt: skip

    def build_decoder(self, cfg: ModelConfig) -> None:
        self.model = Gemma3Model(cfg)  # type: ignore[assignment]

    def embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens


def _gemma3_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config.json (text, or multimodal with a `text_config`) in the shared names, RoPE flattened to the
    global layers' (the sliding layers' goes to `_gemma3_quirks`)."""
    out = dict(hf)
    if isinstance(hf.get("text_config"), dict):
        out = {**hf["text_config"], "architectures": hf.get("architectures")}
        for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "dtype", "torch_dtype"):
            if key in hf:
                out.setdefault(key, hf[key])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if out.get(key):
            raise ConfigError(f"config.json: {key}={out[key]} (Gemma 2's soft-capping) is not supported")
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:  # v5: one RoPE per layer type
        out["rope_parameters"] = rope["full_attention"]
        out["_rope_local"] = rope.get(SLIDING) or rope["full_attention"]
    else:  # v4: rope_theta (+ rope_scaling) global, rope_local_base_freq for the sliding layers
        out["_rope_local"] = {"rope_type": "default", "rope_theta": out.get("rope_local_base_freq", 10000.0)}
    out.setdefault("hidden_act", out.get("hidden_activation") or "gelu_pytorch_tanh")
    out.setdefault("tie_word_embeddings", True)
    out.setdefault("head_dim", 256)
    if not out.get("layer_types"):
        pattern = int(out.get("sliding_window_pattern") or out.get("_sliding_window_pattern") or 6)
        n = int(out["num_hidden_layers"])
        out["layer_types"] = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]
    return out


def _gemma3_quirks(hf: dict[str, Any]) -> dict[str, Any]:
    local: RopeConfig = rope_from_hf({"rope_parameters": hf["_rope_local"]})
    return {"qk_norm": True, "layer_types": tuple(hf["layer_types"]), "rope_local": local,
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or hf["head_dim"])}  # fmt: skip


def _gemma3_make_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """make-model's shape fields -> Gemma3TextConfig's (v5 `rope_parameters` per layer type)."""
    out = dict(fields)
    theta, local = out.pop("rope_theta", 1000000.0), out.pop("rope_local_base_freq", 10000.0)
    out["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": theta},
                              SLIDING: {"rope_type": "default", "rope_theta": local}}  # fmt: skip
    return out


GEMMA3 = ModelFamily(
    "gemma3",
    ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    ("gemma3_text", "gemma3"),
    Gemma3ForCausalLM,
    "Gemma3TextConfig",
    "GEMMA3",  # GGUF: NeoX RoPE as HF, no Q/K permutation; llama.cpp stores norms as 1 + w (gguf_names.py)
    adapt_config=_gemma3_quirks,
    normalize_hf=_gemma3_config,
    make_fields=_gemma3_make_fields,
)

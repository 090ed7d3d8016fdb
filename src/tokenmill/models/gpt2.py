"""GPT-2 (`GPT2LMHeadModel`): the classic teaching model, and the origin of the byte-level BPE.

Where it differs from the Llama-shaped stack of layers.py:
- learned absolute position embeddings (`wpe`) added to the token embeddings, no RoPE;
- LayerNorm with bias (pre-norm), and a final `ln_f`;
- multi-head attention with biases on the fused q|k|v (`c_attn`) and the output (`c_proj`);
- a plain MLP: `c_fc`, GELU (tanh approximation, "gelu_new"), `c_proj`;
- Conv1D weights, stored [in, out]: the loader turns them around (`hf_transposed`);
- the LM head tied to the token embedding.
Modules are named as in the checkpoint (`transformer.h.N.attn.c_attn`, ...), so weights map one to one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention import KVBackend
from tokenmill.errors import ConfigError
from tokenmill.model_config import ModelConfig
from tokenmill.models.family import ModelFamily
from tokenmill.models.layers import CausalLM, activation, embedding
from tokenmill.models.linear import Linear


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, cfg.num_heads, cfg.head_dim
        width = cfg.num_heads * cfg.head_dim  # the hidden size, or a tensor-parallel rank's share of it
        self.c_attn = Linear(cfg.hidden_size, 3 * width)
        self.c_proj = Linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor, kv: KVBackend, meta: Any) -> torch.Tensor:  # [T, D] -> [T, D]
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))  # [T, H, Dh]
        kv.write(self.layer_idx, k, v, meta)
        o = kv.attend(self.layer_idx, q, k, v, meta)  # [T, H, Dh]
        return self.c_proj(o.reshape(x.shape[0], -1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.c_proj(activation(self.act, self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, kv: KVBackend, meta: Any) -> torch.Tensor:  # [T, D] -> [T, D]
        x = x + self.attn(self.ln_1(x), kv, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVBackend, meta: Any) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)  # [T, D]
        for block in self.h:
            x = block(x, kv, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(CausalLM):
    hf_transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    hf_ignored = (".attn.bias", ".attn.masked_bias")  # the causal-mask buffers of older checkpoints

    def build_decoder(self, cfg: ModelConfig) -> None:
        self.transformer = GPT2Model(cfg)

    def decoder(self) -> nn.Module:
        return self.transformer

    def embeddings(self) -> nn.Embedding:
        return self.transformer.wte


def _gpt2_config(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's config.json names (n_embd, n_layer, ...) -> the shared ones ModelConfig.from_hf reads."""
    n_embd = hf.get("n_embd", hf.get("hidden_size"))
    out = dict(hf)
    out.update(
        hidden_size=n_embd,
        num_attention_heads=hf.get("n_head", hf.get("num_attention_heads")),
        num_hidden_layers=hf.get("n_layer", hf.get("num_hidden_layers")),
        max_position_embeddings=hf.get("n_positions", hf.get("max_position_embeddings", 1024)),
        intermediate_size=hf.get("n_inner") or 4 * int(n_embd or 0),
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_act=hf.get("activation_function", "gelu_new"),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),  # GPT2Config's default, often left out
    )
    for unsupported in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(unsupported):
            raise ConfigError(f"config.json: GPT-2 with {unsupported}=true is not supported")
    if hf.get("scale_attn_weights") is False:
        raise ConfigError("config.json: GPT-2 with scale_attn_weights=false is not supported")
    return out


def _gpt2_make_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """make-model's shared shape fields -> GPT2Config's."""
    out = {k: v for k, v in fields.items() if not k.startswith("rope") and k != "num_key_value_heads"}
    out["n_inner"] = out.pop("intermediate_size", None)
    if "rms_norm_eps" in out:
        out["layer_norm_epsilon"] = out.pop("rms_norm_eps")
    return out


GPT2 = ModelFamily("gpt2", ("GPT2LMHeadModel",), ("gpt2",), GPT2LMHeadModel, "GPT2Config", "GPT2",
                   normalize_hf=_gpt2_config, make_fields=_gpt2_make_fields)  # fmt: skip

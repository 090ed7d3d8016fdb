"""Which GGUF tensor is which Hugging Face tensor, per GGUF architecture: one table for the loader (GGUF -> HF)
and the exporter (HF -> GGUF). Names are module paths without `.weight`/`.bias`; `{bid}` is the layer index.

The GGUF names are llama.cpp's (`gguf.TENSOR_NAMES`, written by its convert_hf_to_gguf.py).
"""

from __future__ import annotations

import re

# the Llama-shaped decoders (llama, qwen2, qwen3)
_DECODER = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "model.layers.{bid}.input_layernorm": "blk.{bid}.attn_norm",
    "model.layers.{bid}.self_attn.q_proj": "blk.{bid}.attn_q",
    "model.layers.{bid}.self_attn.k_proj": "blk.{bid}.attn_k",
    "model.layers.{bid}.self_attn.v_proj": "blk.{bid}.attn_v",
    "model.layers.{bid}.self_attn.o_proj": "blk.{bid}.attn_output",
    "model.layers.{bid}.self_attn.q_norm": "blk.{bid}.attn_q_norm",
    "model.layers.{bid}.self_attn.k_norm": "blk.{bid}.attn_k_norm",
    "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.ffn_norm",
    "model.layers.{bid}.mlp.gate_proj": "blk.{bid}.ffn_gate",
    "model.layers.{bid}.mlp.up_proj": "blk.{bid}.ffn_up",
    "model.layers.{bid}.mlp.down_proj": "blk.{bid}.ffn_down",
    "model.layers.{bid}.mlp.gate": "blk.{bid}.ffn_gate_inp",  # a MoE layer's router (qwen3moe; Mixtral's llama)
}
_GPT2 = {
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
    "lm_head": "output",
    "transformer.h.{bid}.ln_1": "blk.{bid}.attn_norm",
    "transformer.h.{bid}.attn.c_attn": "blk.{bid}.attn_qkv",
    "transformer.h.{bid}.attn.c_proj": "blk.{bid}.attn_output",
    "transformer.h.{bid}.ln_2": "blk.{bid}.ffn_norm",
    "transformer.h.{bid}.mlp.c_fc": "blk.{bid}.ffn_up",
    "transformer.h.{bid}.mlp.c_proj": "blk.{bid}.ffn_down",
}
# Gemma 3: a norm before and after attention and the MLP; llama.cpp stores every norm weight as 1 + w
_GEMMA3 = {
    **{k: v for k, v in _DECODER.items() if "post_attention_layernorm" not in k},
    "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.post_attention_norm",
    "model.layers.{bid}.pre_feedforward_layernorm": "blk.{bid}.ffn_norm",
    "model.layers.{bid}.post_feedforward_layernorm": "blk.{bid}.post_ffw_norm",
}
# Phi-3: q|k|v and gate|up fused, in HF's checkpoint as in llama.cpp's file (`ffn_up` holds gate then up, the order
# of HF's `gate_up_proj`); a file with separate `attn_q/k/v` (llama.cpp's phi3 loader accepts either) loads too
_PHI3 = {
    **{k: v for k, v in _DECODER.items() if not k.endswith(("_norm", "gate_proj", "up_proj"))},
    "model.layers.{bid}.self_attn.qkv_proj": "blk.{bid}.attn_qkv",
    "model.layers.{bid}.mlp.gate_up_proj": "blk.{bid}.ffn_up",
}
# gpt-oss: `post_attention_norm` is the norm before the MLP; the router (`mlp.router`, with a bias) and the attention
# sinks (a bare parameter in HF: `self_attn.sinks`, no `.weight`) have their own names
_GPT_OSS = {
    **{k: v for k, v in _DECODER.items() if "_norm" not in k and ".mlp." not in k and "post_attention" not in k},
    "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.post_attention_norm",
    "model.layers.{bid}.self_attn.sinks": "blk.{bid}.attn_sinks",
    "model.layers.{bid}.mlp.router": "blk.{bid}.ffn_gate_inp",
}
_BARE = (".self_attn.sinks",)  # HF parameters named without a `.weight`
HF_TO_GGUF: dict[str, dict[str, str]] = {
    "llama": _DECODER, "qwen2": _DECODER, "qwen3": _DECODER, "gpt2": _GPT2, "gemma3": _GEMMA3, "phi3": _PHI3,
    "qwen3moe": _DECODER, "gpt-oss": _GPT_OSS,
}  # fmt: skip
# A MoE layer's experts: one tensor per projection holding every expert, [E, rows, cols], in a GGUF
# (`blk.N.ffn_gate_exps`, and gpt-oss's biases [E, rows]; older Mixtral files: one per expert, `blk.N.ffn_gate.E`);
# one per expert in HF (`model.layers.N.mlp.experts.E.gate_proj`)
_GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(?:_exps|\.(\d+))\.(weight|bias)")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def gguf_experts(name: str) -> tuple[int, str, int | None, str] | None:
    """A GGUF expert tensor's (layer, HF projection, expert: None where it holds them all, "weight" | "bias"), else
    None."""
    found = _GGUF_EXPERTS.fullmatch(name)
    if found is None:
        return None
    layer, proj, expert, kind = found.groups()
    return int(layer), f"{proj}_proj", None if expert is None else int(expert), kind


def hf_expert(name: str) -> tuple[int, str, int] | None:
    """An HF expert tensor's (layer, projection, expert), else None."""
    found = _HF_EXPERT.fullmatch(name)
    return None if found is None else (int(found.group(1)), f"{found.group(3)}_proj", int(found.group(2)))


def hf_expert_name(layer: int, proj: str, expert: int, kind: str = "weight") -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{kind}"


def gguf_experts_name(layer: int, proj: str) -> str:
    return f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"


def _split(name: str) -> tuple[str, int | None, str]:
    """'a.b.3.c.weight' -> ('a.b.{bid}.c', 3, 'weight'); the block index is the first all-digit part."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            parts[i] = "{bid}"
            return ".".join(parts), int(part), suffix
    return stem, None, suffix


def _translate(name: str, table: dict[str, str]) -> str | None:
    template, bid, suffix = _split(name)
    target = table.get(template)
    if target is None:
        return None
    return (target.format(bid=bid) if bid is not None else target) + f".{suffix}"


def gguf_to_hf(arch: str, name: str) -> str | None:
    """The HF name of GGUF tensor `name` (None: not one this arch maps)."""
    hf = _translate(name, {v: k for k, v in HF_TO_GGUF[arch].items()})
    return hf.removesuffix(".weight") if hf is not None and hf.removesuffix(".weight").endswith(_BARE) else hf


def hf_to_gguf(arch: str, name: str) -> str | None:
    """The GGUF name of HF tensor `name` (None: not one this arch maps)."""
    return _translate(name, HF_TO_GGUF[arch])

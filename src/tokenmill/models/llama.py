"""Llama family: Llama 2/3/3.x (incl. `llama3` RoPE scaling), TinyLlama, SmolLM, and Mistral.

Llama is the reference decoder: pre-norm RMSNorm, rotary attention with grouped-query heads, SiLU-gated MLP.
Everything it needs lives in `layers.py`; its options (`attention_bias`, `mlp_bias`, `head_dim`, RoPE
scaling) are plain config.json fields, so neither family has quirks to adapt.
"""

from __future__ import annotations

from tokenmill.models.family import ModelFamily
from tokenmill.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    pass


class MistralForCausalLM(CausalLM):
    """Mistral is Llama with a sliding-window option (v0.1: 4096): every layer attends to the last
    `sliding_window` positions (the KV backends apply `ModelConfig.layer_windows()`)."""


# llama.cpp's `llama` arch rotates interleaved pairs (GPT-J style): the GGUF export permutes Q/K rows
LLAMA = ModelFamily("llama", ("LlamaForCausalLM",), ("llama",), LlamaForCausalLM, "LlamaConfig", "LLAMA", True)
MISTRAL = ModelFamily(
    "mistral", ("MistralForCausalLM",), ("mistral",), MistralForCausalLM, "MistralConfig", "LLAMA", True
)

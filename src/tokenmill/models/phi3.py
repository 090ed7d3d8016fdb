"""Phi-3 / Phi-3.5-mini (`Phi3ForCausalLM`): the Llama-shaped stack with two differences in the checkpoint.

- q|k|v and gate|up are stored fused (`qkv_proj`, `gate_up_proj`), as our layers hold them: the loader fills
  them whole.
- `longrope` RoPE scaling (Phi-3 128k, Phi-3.5): per-frequency factors, short up to the pretraining context and
  long past it, and long from position 0 for a prompt longer than that context (rope.RotaryEmbedding).
"""

from __future__ import annotations

from tokenmill.models.family import ModelFamily
from tokenmill.models.layers import CausalLM


class Phi3ForCausalLM(CausalLM):
    pass


# llama.cpp's `phi3` arch rotates halves, as HF does: no Q/K permutation in the GGUF export
PHI3 = ModelFamily("phi3", ("Phi3ForCausalLM",), ("phi3",), Phi3ForCausalLM, "Phi3Config", "PHI3")

"""Qwen families. Both are Llama-shaped; the differences arrive through `ModelConfig`:

- Qwen2 / Qwen2.5: bias on the q/k/v projections (always), none on o_proj.
- Qwen3: RMSNorm over each head's q and k (`qk_norm`) before RoPE; biases follow `attention_bias`.
"""

from __future__ import annotations

from tokenmill.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    pass


class Qwen3ForCausalLM(CausalLM):
    pass

"""peft adapters for the LoRA tests, made here on a tiny checkpoint: random A and non-zero random B
(`init_lora_weights=False`), so each adapter changes what the model computes."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(
    checkpoint: Path, out: Path, targets: list[str], r: int, alpha: int, rslora: bool = False, seed: int = 0
) -> Path:  # fmt: skip
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) for `checkpoint`, written to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora,
                        lora_dropout=0.0)  # fmt: skip
    get_peft_model(base, config).save_pretrained(out)
    return out

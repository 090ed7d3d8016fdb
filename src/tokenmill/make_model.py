"""Write real checkpoint folders with random weights at real model shapes (no hub needed).

Benchmarks need realistic models: the same matmul sizes, vocabulary and tokenizer cost as the real thing.
transformers builds and initialises the model from its config and `save_pretrained` writes the folder, so
the result is exactly what a Hugging Face user would have on disk, minus the training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.config import DTYPES as config_dtypes

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    ),
    "smollm-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    "qwen2.5-1.5b": dict(  # every row a multiple of 256: a Q4_K_M file of it really is K-quants
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    "gpt2": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, vocab_size=50257, max_position_embeddings=1024, tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "phi-3-mini": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    ),
    "gemma-3-1b": dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512, query_pre_attn_scalar=256,
        tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "llama-3.1-8b": dict(  # issue 63's roofline shape: 8.0B parameters, 16 GB in bf16 (`--device cuda` draws them)
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    # mixtures of experts (`--arch qwen3_moe` / `mixtral`): the real models' shapes, and a small one that fits a laptop
    "qwen3-30b-a3b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "qwen3-moe-small": dict(  # 32 experts, 4 per token: ~0.6B parameters, ~0.2B of them active
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-6, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=512, norm_topk_prob=True,
    ),
    # gpt-oss (`--arch gpt_oss`): its RoPE is YaRN (factor 32 over 4096, gpt_oss.py's default); windows of 128 in every
    # other layer. make-model writes the experts in bf16, transformers' layout (the released checkpoints: MXFP4)
    "gpt-oss-20b": dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, vocab_size=201088, max_position_embeddings=131072, rope_theta=150000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, swiglu_limit=7.0,
    ),
    "gpt-oss-small": dict(  # 32 experts, 4 per token: ~1.0B parameters, ~0.4B of them active (0.24B embeddings)
        hidden_size=768, intermediate_size=768, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, vocab_size=201088, max_position_embeddings=131072, rope_theta=150000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128,
    ),
    "mixtral-8x7b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=2,
    ),
}  # fmt: skip
DTYPES = tuple(d for d in config_dtypes if d != "auto")


def hf_config(arch: str, **fields: Any) -> Any:
    """A transformers config object for one of our families (`arch` is the family's name)."""
    import transformers

    from tokenmill.models import family_named

    family = family_named(arch)
    return getattr(transformers, family.hf_config_class)(**family.make_fields(fields))


def write_checkpoint(
    config: Any,
    tokenizer_dir: str | Path | None,
    out: str | Path,
    dtype: str = "float32",
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """Initialise a model from `config` with `seed` on `device`, save it with its tokenizer into `out`. The same
    seed draws other values on a GPU than on the CPU (another generator)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    where = _device(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir is not None else None
    if tokenizer is not None:
        if len(tokenizer) > config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}"
            )
        eos = tokenizer.eos_token_id
        config.eos_token_id = eos
        config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
        config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    with where:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def _device(name: str) -> Any:
    """torch's device `name`, checked here: ValueError with one line where this machine has none such."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; allowed: cpu, cuda, cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: make-model draws weights on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        raise ValueError(f"--device {name!r}: this machine has {count} CUDA GPU(s); use --device cpu")
    return device


def shape_fields(shape: str, tokenizer_dir: str | Path) -> dict[str, Any]:
    """`shape`'s config fields; the tiny shape's vocabulary as large as the tokenizer's, rounded up like real ones."""
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is not supported; allowed: {', '.join(SHAPES)}")
    if not Path(tokenizer_dir).is_dir():
        raise ValueError(f"--tokenizer {str(tokenizer_dir)!r} is not a folder holding a Hugging Face tokenizer")
    fields = dict(SHAPES[shape])
    if "vocab_size" not in fields:
        from transformers import AutoTokenizer

        n = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
        fields["vocab_size"] = (n + 63) // 64 * 64
    return fields


def make_model(
    arch: str, shape: str, tokenizer_dir: str | Path, out: str | Path, dtype: str, seed: int, device: str = "cpu"
) -> Path:
    fields = shape_fields(shape, tokenizer_dir)
    from tokenmill.progress import progress

    with progress(f"make-model: {arch} at the {shape} shape"):
        return write_checkpoint(hf_config(arch, **fields), tokenizer_dir, out, dtype, seed, device)

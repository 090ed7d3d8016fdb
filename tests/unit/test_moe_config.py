"""A mixture of experts' config: which layers are sparse, the real models' shapes, and one line for a bad config."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.errors import ConfigError
from tokenmill.make_model import SHAPES, hf_config
from tokenmill.models import family_for


def _config(arch: str, **fields: Any) -> Any:
    return family_for(hf_config(arch, **fields).to_dict()).config_from_hf(hf_config(arch, **fields).to_dict())


def _params(cfg: Any) -> tuple[float, float]:
    """(all parameters, those one token reads), in billions: attention, experts (all / top k) and embeddings."""
    d, moe = cfg.hidden_size, cfg.moe
    attention = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    expert = 3 * d * moe.intermediate_size
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    total = cfg.num_layers * (attention + moe.num_experts * expert) + embeddings
    active = cfg.num_layers * (attention + moe.top_k * expert) + embeddings
    return total / 1e9, active / 1e9


@pytest.mark.parametrize("shape,arch,total,active", [("qwen3-30b-a3b", "qwen3_moe", 30.5, 3.3),
                                                     ("mixtral-8x7b", "mixtral", 46.7, 12.9),
                                                     ("gpt-oss-20b", "gpt_oss", 20.9, 4.2)])  # fmt: skip
def test_make_model_shapes_are_the_real_models(shape: str, arch: str, total: float, active: float) -> None:
    cfg = _config(arch, **SHAPES[shape])
    assert cfg.moe is not None and all(cfg.moe.sparse_layers)
    got_total, got_active = _params(cfg)
    assert got_total == pytest.approx(total, rel=0.02) and got_active == pytest.approx(active, rel=0.02)


def test_sparse_layers_follow_the_step_and_the_dense_list() -> None:
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=384, num_experts=4, num_experts_per_tok=2)  # fmt: skip
    assert _config("qwen3_moe", **fields).moe.sparse_layers == (True,) * 6
    stepped = _config("qwen3_moe", **fields, decoder_sparse_step=2, mlp_only_layers=[3])
    assert stepped.moe.sparse_layers == (False, True, False, False, False, True)
    mixtral = _config("mixtral", **{k: v for k, v in fields.items() if k != "num_experts"}, num_local_experts=4)
    assert mixtral.moe.norm_topk_prob and mixtral.moe.weights_in_float32 and mixtral.moe.intermediate_size == 96


def test_a_bad_moe_config_is_one_line() -> None:
    base = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=384, num_experts=4)  # fmt: skip
    family = family_for(base)
    with pytest.raises(ConfigError, match="missing the required MoE field 'num_experts_per_tok'"):
        family.config_from_hf(base)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
        family.config_from_hf({**base, "num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match="moe_intermediate_size=-1 must be >= 1"):
        family.config_from_hf({**base, "num_experts_per_tok": 2, "moe_intermediate_size": -1})
    awq = {**base, "num_experts_per_tok": 2, "quantization_config": {"quant_method": "awq", "bits": 4}}
    with pytest.raises(ConfigError, match="quant_method 'awq' is not supported for Qwen3MoeForCausalLM.*: fp8$"):
        family.config_from_hf(awq)


# openai/gpt-oss-20b's config.json as released (transformers v4 names: rope_scaling, torch_dtype)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


def test_gpt_oss_20b_config_as_released() -> None:
    """Windows of 128 in every other layer (the first sliding), YaRN over 4096 untruncated, sinks, biases on
    attention and experts, the clamped SwiGLU, 4 of 32 experts; its make-model shape is the same model."""
    cfg = family_for(GPT_OSS_20B).config_from_hf(GPT_OSS_20B)
    assert cfg.layer_windows() == [128, None] * 12
    assert (cfg.rope.kind, cfg.rope.theta, cfg.rope.params["factor"], cfg.rope.params["truncate"]) == (
        "yarn", 150000.0, 32.0, False)  # fmt: skip
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k) == (32, 4)
    assert cfg.moe.clamped_swiglu == (1.702, 7.0) and cfg.torch_dtype == "bfloat16"
    made = _config("gpt_oss", **SHAPES["gpt-oss-20b"])
    assert (made.layer_windows(), made.rope, made.moe) == (cfg.layer_windows(), cfg.rope, cfg.moe)


@pytest.mark.parametrize("archs", ["LlamaForCausalLM", [5], {"a": 1}])
def test_architectures_that_are_not_a_list_of_names_say_so(archs: Any) -> None:
    """A string was read as a list of its letters ("architecture 'L' is not supported")."""
    with pytest.raises(ConfigError, match=r"architectures is .*; allowed a list of names"):
        family_for({"architectures": archs, "model_type": "llama"})

"""gpt-oss's part of `make-model --gguf` (bench/gguf_random.py): the `gpt-oss` arch's hyperparameters and tensor
list as llama.cpp's converter writes them (its `openai-moe` model reads them), for a random file at the gpt-oss-20b
shape. `--gguf mxfp4` gives the released files' types: the experts in MXFP4, the other matrices in Q8_0 (llama.cpp's
MXFP4_MOE); norms, sinks, routers and biases in F32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenmill.bench.gguf_export import _write_shape

Spec = tuple[str, tuple[int, ...], str]  # (GGUF name, shape in torch order, our dtype name)


def write_gpt_oss_hparams(writer: Any, config: dict[str, Any]) -> None:
    """The `gpt-oss` keys llama.cpp reads: the shape, YaRN, the experts, the window of every other layer."""
    import gguf

    rope = config["rope_parameters"]
    head_dim = _write_shape(writer, config)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])


def gpt_oss_tensors(cfg: Any, kind: str) -> Iterator[Spec]:
    """Every tensor of a gpt-oss model; matrices in `kind`, or with `mxfp4` the experts in MXFP4 and the rest Q8_0."""
    d, q, kv, n = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_layers
    e, width = cfg.moe.num_experts, cfg.moe.intermediate_size
    dense, experts = ("q8_0", "mxfp4") if kind == "mxfp4" else (kind, kind)
    yield "token_embd.weight", (cfg.vocab_size, d), dense
    yield "output_norm.weight", (d,), "f32"
    yield "output.weight", (cfg.vocab_size, d), dense
    for i in range(n):
        blk = f"blk.{i}."
        yield blk + "attn_norm.weight", (d,), "f32"
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield blk + name + ".weight", (rows, d), dense
            yield blk + name + ".bias", (rows,), "f32"
        yield blk + "attn_output.weight", (d, q), dense
        yield blk + "attn_output.bias", (d,), "f32"
        yield blk + "attn_sinks.weight", (cfg.num_heads,), "f32"
        yield blk + "post_attention_norm.weight", (d,), "f32"
        yield blk + "ffn_gate_inp.weight", (e, d), "f32"
        yield blk + "ffn_gate_inp.bias", (e,), "f32"
        for proj, shape in (("gate", (e, width, d)), ("up", (e, width, d)), ("down", (e, d, width))):
            yield blk + f"ffn_{proj}_exps.weight", shape, experts
            yield blk + f"ffn_{proj}_exps.bias", shape[:2], "f32"

"""gpt-oss beyond the parity table of test_models.py: checkpoints as OpenAI released them (experts in MXFP4), every
attention path sinks run through, and what the family refuses.

- An MXFP4 checkpoint is written here from a transformers one (kernels/mxfp4.quantize); transformers loads it too,
  dequantizing, and our logits and greedy tokens are its own. Each expert's weight is the dequantized value exactly,
  in float32 and bfloat16 alike (every MXFP4 value is a bfloat16).
- The prompt runs past the window of 8 in prefill and decode, on the paged pool with the CPU kernels (sinks in the
  decode and prefill kernels) and without them (torch), on the contiguous store and with no cache, alike.
- A `gpt-oss` GGUF as llama.cpp's converter writes it (MXFP4 experts; written here with the `gguf` package) loads as
  the transformers model with the experts its blocks hold.
- Tensor parallelism, an unknown quantization or layer type, and half an MXFP4 weight are one line at load.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.attention import causal
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.kernels import mxfp4
from tokenmill.models.gpt_oss import GptOssMoE

GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, initializer_range=0.1)
PROMPT = "To be, or not to be, that is the question. Hello world! Shall I compare thee to a summer's day?"
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_mxfp4(folder: Path, out: Path) -> Path:
    """`folder`'s checkpoint with its experts' weights in MXFP4, as the released gpt-oss checkpoints hold them:
    `*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32] for the [E, in, out] `gate_up_proj` / `down_proj`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4.quantize(t.transpose(1, 2))
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("gpt_oss", **GPT_OSS)


@pytest.fixture(scope="module")
def mxfp4_folder(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mxfp4(folder, tmp_path_factory.mktemp("gpt-oss-mxfp4") / "ckpt")


def _hf(folder: Path, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs).to(target.DEVICE).eval()


def _hf_greedy(hf: Any, ids: list[int], n: int = 24) -> list[int]:
    with torch.no_grad():
        out = hf.generate(target.ids_tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def _greedy(llm: LLM, ids: list[int], n: int = 24) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids


def test_an_mxfp4_checkpoint_runs_its_experts_in_the_mxfp4_kernels(mxfp4_folder: Path) -> None:
    """On the CPU the experts stay MXFP4 blocks in the kernels' format (a 20B checkpoint in ~13 GB), whose product
    quantizes its rows to Q8_0 blocks as llama.cpp's does: the logits are the pure-torch reference's of the same
    formats to 1e-4, and transformers' (on the dequantized experts) to that rounding. Elsewhere the experts load
    dequantized, and the logits and tokens are transformers' exactly."""
    from transformers import Mxfp4Config

    hf = _hf(mxfp4_folder, quantization_config=Mxfp4Config(dequantize=True))
    llm = LLM(str(mxfp4_folder), dtype="float32", device=target.DEVICE)
    if target.DEVICE != "cpu" or llm.loaded.ops is None:
        return _assert_transformers_logits_and_tokens(llm, hf)
    experts = sum(len(m.experts) for m in llm.loaded.model.modules() if isinstance(m, GptOssMoE))
    assert llm.loaded.kernels.get("mxfp4") == 2 * experts, llm.loaded.kernels
    ids = llm.tokenizer.encode(PROMPT)
    reference = LLM(str(mxfp4_folder), dtype="float32", cpu_kernels=False)
    assert torch.allclose(_logits(llm, ids), _logits(reference, ids), rtol=0, atol=1e-4)
    with torch.inference_mode():
        ref = hf(target.ids_tensor([ids])).logits[0].float().cpu()
    assert (_logits(llm, ids) - ref).abs().max().item() < 0.1


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [T, V] float32, a whole prompt's
    model = llm.loaded.model
    with torch.inference_mode():
        hidden = model(target.ids_tensor(ids), target.positions(0, len(ids)),
                       *causal(len(ids), llm.loaded.config.layer_windows()))  # fmt: skip
        return model.compute_logits(hidden).cpu()


def _assert_transformers_logits_and_tokens(llm: LLM, hf: Any) -> None:
    """A whole prompt's float32 logits within 1e-4 of transformers', and 24 greedy tokens equal to its own."""
    ids = llm.tokenizer.encode(PROMPT)
    ours = _logits(llm, ids)
    with torch.inference_mode():
        ref = hf(target.ids_tensor([ids])).logits[0].float().cpu()
    assert (ours - ref).abs().max().item() < 1e-4
    assert _greedy(llm, ids) == _hf_greedy(hf, ids)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_experts_load_as_their_exact_values(mxfp4_folder: Path, dtype: str) -> None:
    """Each expert's [gate | up] and down weights are the blocks' values (gate and up de-interleaved), unrounded."""
    from safetensors.torch import load_file

    from tokenmill.kernels import formats
    from tokenmill.models.linear import KernelLinear

    def weight(linear: torch.nn.Module) -> torch.Tensor:  # [out, in] float32: the MXFP4 panels' values, or dense
        return formats.unpack(linear.packed()) if isinstance(linear, KernelLinear) else linear.weight.float()

    stored = load_file(str(mxfp4_folder / "model.safetensors"))
    llm = LLM(str(mxfp4_folder), dtype=dtype, device="cpu", cpu_kernels=False)
    for i, layer in enumerate(llm.loaded.model.model.layers):
        stem = f"model.layers.{i}.mlp.experts"
        gate_up = mxfp4.dequantize(stored[f"{stem}.gate_up_proj_blocks"], stored[f"{stem}.gate_up_proj_scales"])
        down = mxfp4.dequantize(stored[f"{stem}.down_proj_blocks"], stored[f"{stem}.down_proj_scales"])
        for e, expert in enumerate(layer.mlp.experts):
            want = torch.cat([gate_up[e, 0::2], gate_up[e, 1::2]])  # [2I, D]
            assert torch.equal(weight(expert.gate_up_proj), want)
            assert torch.equal(weight(expert.down_proj), down[e])


@pytest.mark.parametrize("engine", [dict(), dict(cpu_kernels=False), dict(kv_cache="contiguous"),
                                    dict(kv_cache="none"), dict(batch_invariant=True)])  # fmt: skip
def test_every_attention_path_gives_transformers_tokens(folder: Path, engine: dict[str, Any]) -> None:
    """Sinks and the window of 8 in each backend: the paged pool through the CPU kernels (decode, prefill and the
    batch-invariant per-row decode) or torch, the contiguous store, and recompute without a cache."""
    if engine.get("batch_invariant"):
        target.cpu_only("the batch-invariant CPU kernels")
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE, **engine)
    ids = llm.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * 8
    assert _greedy(llm, ids) == _hf_greedy(_hf(folder), ids)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_experts_take_one_kernel_call_with_the_modules_bits(folder: Path, dtype: str) -> None:
    """Each layer's experts run in one call of the CPU kernels (linear/experts.h: the biases, the clamped SwiGLU),
    whose rows are each expert module's own bits, at one row per expert and at many. (Decode steps take the decode
    stack: tests/engine/test_moe.py holds it to the modules' tokens.)"""
    llm = LLM(str(folder), dtype=dtype, device=target.DEVICE)
    if target.DEVICE != "cpu" or llm.loaded.ops is None:
        pytest.skip("the one-call expert kernel is the CPU kernels'")
    moes = [m for m in llm.loaded.model.modules() if isinstance(m, GptOssMoE)]
    torch.manual_seed(0)
    for tokens in (1, 5, 30):
        x = torch.randn(tokens, 64).to(getattr(torch, dtype))
        with torch.inference_mode():
            for moe in moes:
                moe._experts_call = None
                fused = moe(x)
                assert moe._experts_call, "the one-call path was not taken"
                moe._experts_call = ()
                assert torch.equal(fused, moe(x)), tokens
                moe._experts_call = None


def test_the_stacks_checked_calls_refuse_bad_sinks_and_expert_biases(folder: Path) -> None:
    """kernels/stack_ops.py checks what gpt-oss adds before a pointer crosses: sinks that are not float32 [heads] or
    for a layer not added, and an expert bias table pointing at tensors it was not given, are each a ValueError; the
    engine decodes on afterwards."""
    from dataclasses import replace

    from tokenmill.models.decode_stack import _experts

    target.cpu_only("the decode stack")
    llm = LLM(str(folder), dtype="float32")
    if llm.loaded.ops is None:
        pytest.skip("no compiled CPU kernels here: the decode stack needs them")
    stack = llm.engine.runner.decode_stack
    assert stack is not None
    native, heads = stack.native, stack.native.shape.heads
    for layer, sinks, what in ((0, torch.zeros(heads + 1), "attention sinks"),
                               (0, torch.zeros(heads, dtype=torch.bfloat16), "attention sinks"),
                               (10**6, torch.zeros(heads), "has not been added")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            native.set_sinks(layer, sinks)
    moe = next(m for m in llm.loaded.model.modules() if isinstance(m, GptOssMoE))
    experts = _experts(moe, native.shape.d, torch.float32)
    assert experts is not None and experts.gate_up_bias is not None and experts.clamped_swiglu is not None
    with pytest.raises(ValueError, match="bias pointers must be their biases'"):
        native._check_expert_biases(replace(experts, biases=experts.biases[1:]))
    assert len(_greedy(llm, llm.tokenizer.encode(PROMPT), 8)) == 8


def test_tensor_parallel_refuses_gpt_oss(folder: Path) -> None:
    with pytest.raises(ConfigError, match="not GptOssForCausalLM"):
        LLM(str(folder), dtype="float32", tensor_parallel_size=2)


def _edited(folder: Path, out: Path, **fields: Any) -> Path:
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    return out


def test_variants_we_do_not_run_are_one_line(folder: Path, mxfp4_folder: Path, tmp_path: Path) -> None:
    fp8 = _edited(folder, tmp_path / "fp8", quantization_config={"quant_method": "fp8"})
    with pytest.raises(ConfigError, match="quant_method 'fp8' is not supported for GptOssForCausalLM"):
        LLM(str(fp8))
    chunked = _edited(folder, tmp_path / "chunked", layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(ConfigError, match=r"layer_types \['chunked_attention'\] are not supported"):
        LLM(str(chunked))
    from safetensors.torch import load_file, save_file

    half = _edited(mxfp4_folder, tmp_path / "half")
    tensors = load_file(str(half / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(half / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj_blocks came without their blocks or scales"):
        LLM(str(half))


def write_gguf(folder: Path, out: Path, mxfp4_experts: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    """`folder`'s checkpoint as llama.cpp's convert_hf_to_gguf writes gpt-oss: the `gpt-oss` arch's metadata and
    names, each layer's experts stacked per projection (gate and up de-interleaved) in MXFP4 blocks, the rest F32.
    Also returns the HF checkpoint's tensors with the experts' weights as those blocks hold them."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tokenmill.bench.gguf_export import gguf_file
    from tokenmill.bench.gguf_vocab import write_vocab
    from tokenmill.weights.gguf_names import hf_to_gguf

    config = json.loads((folder / "config.json").read_text())
    rope = config["rope_parameters"]
    tensors, dequantized = load_file(str(folder / "model.safetensors")), {}
    with gguf_file(out, "gpt-oss") as w:
        for add, value in ((w.add_context_length, config["max_position_embeddings"]),
                           (w.add_embedding_length, config["hidden_size"]),
                           (w.add_block_count, config["num_hidden_layers"]),
                           (w.add_feed_forward_length, config["intermediate_size"]),
                           (w.add_head_count, config["num_attention_heads"]),
                           (w.add_head_count_kv, config["num_key_value_heads"]), (w.add_key_length, config["head_dim"]),
                           (w.add_value_length, config["head_dim"]), (w.add_layer_norm_rms_eps, config["rms_norm_eps"]),
                           (w.add_rope_freq_base, rope["rope_theta"]), (w.add_rope_scaling_factor, rope["factor"]),
                           (w.add_rope_scaling_type, gguf.RopeScalingType.YARN),
                           (w.add_rope_scaling_orig_ctx_len, rope["original_max_position_embeddings"]),
                           (w.add_expert_count, config["num_local_experts"]),
                           (w.add_expert_used_count, config["num_experts_per_tok"]),
                           (w.add_expert_feed_forward_length, config["intermediate_size"]),
                           (w.add_sliding_window, config["sliding_window"])):  # fmt: skip
            add(value)
        write_vocab(w, folder, config)
        for name, t in tensors.items():
            stem, _, part = name.rpartition(".experts.")
            if not stem:
                gguf_name = hf_to_gguf("gpt-oss", name + (".weight" if name.endswith(".sinks") else ""))
                assert gguf_name is not None, name
                w.add_tensor(gguf_name, t.float().numpy())
                continue
            layer = stem.split(".")[2]
            if part.endswith("_bias"):  # [E, 2I] interleaved, or [E, D]
                pieces = {"gate": t[:, 0::2], "up": t[:, 1::2]} if part.startswith("gate_up") else {"down": t}
                for proj, b in pieces.items():
                    w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.bias", b.float().contiguous().numpy())
                continue
            rows = t.transpose(1, 2)  # [E, out, in]
            pieces = {"gate": rows[:, 0::2], "up": rows[:, 1::2]} if part == "gate_up_proj" else {"down": rows}
            for proj, weight in pieces.items():
                if not mxfp4_experts:
                    w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", weight.float().contiguous().numpy())
                    continue
                blocks = gguf.quants.quantize(weight.float().contiguous().numpy(), gguf.GGMLQuantizationType.MXFP4)
                w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
                dequantized[(name, proj)] = torch.from_numpy(np.ascontiguousarray(values))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    for (name, proj), values in list(dequantized.items()):
        if proj != "up":  # back to transformers' [E, in, out], gate and up interleaved again
            both = torch.stack([values, dequantized[(name, "up")]], dim=2).flatten(1, 2) if proj == "gate" else values
            tensors[name] = both.transpose(1, 2).contiguous()
    return out, tensors


def test_a_gpt_oss_gguf_gives_transformers_logits_and_tokens(folder: Path, tmp_path: Path) -> None:
    """A `gpt-oss` GGUF (names and metadata as llama.cpp's converter writes them; float experts) loads as the model
    transformers runs."""
    path, _ = write_gguf(folder, tmp_path / "gpt-oss.gguf", mxfp4_experts=False)
    llm = LLM(str(path), dtype="float32", device=target.DEVICE)
    assert llm.loaded.config.layer_windows() == [8, None]
    _assert_transformers_logits_and_tokens(llm, _hf(folder))


def test_a_gpt_oss_ggufs_mxfp4_experts_run_in_the_mxfp4_kernels(folder: Path, tmp_path: Path) -> None:
    """Its MXFP4 experts load into the MXFP4 kernels (not dequantized), each expert's gate|up and down holding
    exactly the values of the file's blocks (transformers' tensors of them), biases as they are; the kernels'
    logits are the pure-torch reference's of the same formats. (Their rows are quantized to Q8_0 blocks, as
    llama.cpp's MXFP4 product takes them, so the logits are not transformers' float ones.)"""
    from tokenmill.kernels import formats
    from tokenmill.models.linear import KernelLinear

    target.cpu_only("the CPU kernels' MXFP4 format")
    path, tensors = write_gguf(folder, tmp_path / "gpt-oss.gguf")
    llm = LLM(str(path), dtype="float32")
    if llm.loaded.ops is None:
        pytest.skip("no compiled CPU kernels here")
    moes = [m for m in llm.loaded.model.modules() if isinstance(m, GptOssMoE)]
    assert moes and llm.loaded.kernels.get("mxfp4") == 2 * sum(len(m.experts) for m in moes), llm.loaded.kernels
    for i, moe in enumerate(moes):
        gate_up = tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, D, 2I], gate and up interleaved
        down = tensors[f"model.layers.{i}.mlp.experts.down_proj"]  # [E, I, D]
        for e, expert in enumerate(moe.experts):
            gu, dn = expert.gate_up_proj, expert.down_proj
            assert isinstance(gu, KernelLinear) and gu.format == "mxfp4" and isinstance(dn, KernelLinear)
            rows = gate_up[e].t()  # [2I, D]
            assert torch.equal(formats.unpack(gu.packed()), torch.cat([rows[0::2], rows[1::2]]))
            assert torch.equal(formats.unpack(dn.packed()), down[e].t())
    reference = LLM(str(path), dtype="float32", cpu_kernels=False)
    ids = llm.tokenizer.encode(PROMPT)
    assert torch.allclose(_logits(llm, ids), _logits(reference, ids), rtol=0, atol=1e-4)
    assert _greedy(llm, ids) == _greedy(reference, ids)

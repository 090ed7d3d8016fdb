"""Every family against Hugging Face transformers on tiny random checkpoints made here.

For each config: float32 logits over a whole prompt agree to 1e-4; decoding with the KV cache gives the
same logits as recomputing the whole context; 32 greedy tokens equal `transformers.generate`; prompt
logprobs equal HF's; bfloat16 agrees within a looser bound. The max diffs land in the run's summary table.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.attention import ContiguousKVCache, causal
from tokenmill.types import SequenceInput

FP32_TOL = 1e-4
BF16_TOL = 0.08  # absolute, on logits of magnitude ~1-3: bf16 keeps ~3 significant digits per matmul

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)  # fmt: skip
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0])  # fmt: skip  # head_dim 16: 8 each

GPTOSS = dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
GPTOSS_MQA = dict(head_dim=32, num_key_value_heads=1, num_hidden_layers=3, num_local_experts=3, num_experts_per_tok=2,
                  sliding_window=6, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                  rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=16.0, beta_slow=2.0, truncate=True,
                                    original_max_position_embeddings=64))  # fmt: skip

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa2": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa-rope-llama3": ("llama", dict(num_key_value_heads=1, rope_scaling=LLAMA3_ROPE)),
    "llama-bias-headdim40": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=40)),
    "llama-rope-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0), rope_theta=500.0)),
    "mistral-gqa4": ("mistral", dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=None)),
    # the prompt (~20 tokens) and its 32 generated ones run far past the window, in prefill and decode
    "mistral-window8": ("mistral", dict(sliding_window=8)),
    "qwen2-bias": ("qwen2", {}),
    "qwen2-tied-yarn": ("qwen2", dict(tie_word_embeddings=True, rope_scaling=YARN_ROPE)),
    "qwen3-qknorm-headdim24": ("qwen3", dict(head_dim=24)),
    "qwen3-tied-bias-mqa": (
        "qwen3",
        dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1),
    ),
    "gpt2-tied": ("gpt2", {}),
    "gpt2-untied-exact-gelu": ("gpt2", dict(tie_word_embeddings=False, activation_function="gelu")),
    "phi3-gqa": ("phi3", {}),
    "phi3-window8": ("phi3", dict(sliding_window=8)),  # Phi-3-mini's window (2047) is real: it binds here
    # one sliding layer (window 8, its own RoPE base) and one global; scores scaled by 24 ** -0.5, not 16 ** -0.5
    "gemma3-window8-scalar24": (
        "gemma3",
        dict(
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_local_base_freq=100.0,
        ),
    ),
    "gemma3-mqa-untied": ("gemma3", dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=False)),
    # prompt and generation stay under 64 positions: the short factors (the long ones: test_longrope_past_...)
    "phi3-longrope": ("phi3", dict(rope_scaling=LONGROPE, original_max_position_embeddings=64)),
    # experts 32 wide, top 2 of 8, weights as the softmax gives them; the second layer dense (`mlp_only_layers`)
    "qwen3moe-top2of8-dense1": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
    ),
    # top 3 of 6, renormalised over the three; only every second layer sparse (`decoder_sparse_step`)
    "qwen3moe-top3of6-norm-step2": (
        "qwen3_moe",
        dict(
            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=2
        ),
    ),
    "mixtral-top2of4": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # sinks, window 8 then full, YaRN (gpt-oss's: factor 32 over 4096, untruncated), biases, the clamped SwiGLU of
    # experts whose gate/up columns interleave, top 2 of 4 softmaxed after the top-k
    "gptoss-window8-top2of4": ("gpt_oss", GPTOSS),
    # one KV head of 32 (the bf16 decode kernel's wide path), three layers full/window/window, truncated YaRN
    "gptoss-mqa-headdim32-3layers": ("gpt_oss", GPTOSS_MQA),
}
SPREAD = dict(initializer_range=0.1)  # larger weights than HF's default: peaked logits, no near-ties in greedy
PROMPT = "To be, or not to be, that is the question. Hello world!"

PARITY_TABLE: dict[str, dict[str, float]] = {}


def _record(config: str, column: str, value: float) -> None:
    PARITY_TABLE.setdefault(config, {})[column] = value


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]) -> tuple[str, Path, Any, LLM]:
    from transformers import AutoModelForCausalLM

    arch, overrides = CONFIGS[request.param]
    folder = make_checkpoint(arch, **SPREAD, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(target.DEVICE).eval()
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE)
    return request.param, folder, hf, llm


def _full_logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [T, V] float32, on the CPU
    model = llm.loaded.model
    with torch.inference_mode():
        windows = llm.loaded.config.layer_windows()
        hidden = model(target.ids_tensor(ids), target.positions(0, len(ids)), *causal(len(ids), windows))
        return model.compute_logits(hidden).float().cpu()


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:  # [T, V] float32, on the CPU
    with torch.no_grad():
        return hf(target.ids_tensor([ids])).logits[0].float().cpu()


def test_prompt_logits_match_transformers(case: tuple[str, Path, Any, LLM]) -> None:
    name, _, hf, llm = case
    ids = llm.tokenizer.encode(PROMPT)
    diff = (_full_logits(llm, ids) - _hf_logits(hf, ids)).abs().max().item()
    _record(name, "fp32 logits", diff)
    assert diff < FP32_TOL


def test_incremental_decode_equals_full_recompute(case: tuple[str, Path, Any, LLM]) -> None:
    name, _, _, llm = case
    model, cfg = llm.loaded.model, llm.loaded.config
    ids = llm.tokenizer.encode(PROMPT)
    steps = 12
    device, windows = torch.device(target.DEVICE), cfg.layer_windows()
    store = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, device, windows)

    def run(start: int, token_ids: list[int]) -> torch.Tensor:  # one forward of "r" over token_ids at start..
        meta = store.prepare([SequenceInput("r", token_ids, start, [], len(ids) + steps, None)], 0)
        return model(target.ids_tensor(token_ids), target.positions(start, start + len(token_ids)), store, meta)

    seq = list(ids)
    cached = []
    with torch.inference_mode():
        # prefill in two chunks (exercises the chunk mask), then one token at a time
        split = len(ids) // 2
        for lo, hi in ((0, split), (split, len(ids))):
            h = run(lo, seq[lo:hi])
        for _ in range(steps):
            logits = model.compute_logits(h[-1:])[0].cpu()
            cached.append(logits)
            seq.append(int(logits.argmax()))
            h = run(len(seq) - 1, seq[-1:])
    full = _full_logits(llm, seq)[len(ids) - 1 : len(ids) - 1 + steps]
    diff = (torch.stack(cached) - full).abs().max().item()
    _record(name, "cached vs recompute", diff)
    assert diff < FP32_TOL


def test_greedy_tokens_match_transformers_generate(case: tuple[str, Path, Any, LLM]) -> None:
    _, _, hf, llm = case
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf.generate(target.ids_tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    assert ours == ref[0, len(ids) :].tolist()


def test_prompt_logprobs_match_transformers(case: tuple[str, Path, Any, LLM]) -> None:
    _, _, hf, llm = case
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    ref = _hf_logits(hf, ids).log_softmax(-1)
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry is not None and ids[pos + 1] in entry and len(entry) <= 3
        assert abs(entry[ids[pos + 1]] - ref[pos, ids[pos + 1]].item()) < FP32_TOL
        top2 = ref[pos].topk(2).indices.tolist()
        assert set(top2) <= set(entry)


def test_bfloat16_close_to_transformers(case: tuple[str, Path, Any, LLM]) -> None:
    from transformers import AutoModelForCausalLM

    name, folder, hf32, _ = case
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to(target.DEVICE).eval()
    llm = LLM(str(folder), dtype="bfloat16", device=target.DEVICE)
    ids = llm.tokenizer.encode(PROMPT)
    diff = (_full_logits(llm, ids) - _hf_logits(hf, ids)).abs().max().item()
    _record(name, "bf16 logits", diff)
    assert diff < BF16_TOL
    # and our bf16 stays as close to the fp32 reference as HF's bf16 does (within 2x)
    ref32 = _hf_logits(hf32, ids)
    ours_err = (_full_logits(llm, ids) - ref32).abs().max().item()
    hf_err = (_hf_logits(hf, ids) - ref32).abs().max().item()
    assert ours_err <= 2 * hf_err + 1e-3


def _skip_without_stack(llm: LLM) -> None:
    from tokenmill.models.layers import DecoderModel

    target.cpu_only()
    if llm.loaded.ops is None:
        pytest.skip("no compiled CPU kernels here: the decode stack needs them")
    if type(llm.loaded.model.decoder()) is not DecoderModel:
        pytest.skip(f"{llm.loaded.config.architecture} is not Llama-shaped: its decode steps run on the modules")
    assert llm.engine.runner.decode_stack is not None


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 0.05)])
def test_decode_stack_equals_the_module_path(case: tuple[str, Path, Any, LLM], dtype: str, tol: float) -> None:
    """A decode-only step runs the whole stack in one kernel call (models/decode_stack.py); a batch of
    sequences at different lengths gets the same tokens and logprobs as the per-module path."""
    target.cpu_only()
    _, folder, _, _ = case
    llm = LLM(str(folder), dtype=dtype, device="cpu")
    runner = llm.engine.runner
    _skip_without_stack(llm)
    ids = llm.tokenizer.encode(PROMPT)
    # a batch, then one row alone (fewer rows than threads: its SiLU in parts, its RoPE inside attention's chunks)
    batches = [[{"prompt_token_ids": ids[:n]} for n in (3, 9, len(ids))], [{"prompt_token_ids": ids[:7]}]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run() -> list[Any]:
        return [o.outputs[0] for prompts in batches for o in llm.generate(prompts, params)]

    stacked = run()
    stack, runner.decode_stack = runner.decode_stack, None
    modules = run()
    assert stack is not None and len(stacked) == 4
    for a, b in zip(stacked, modules):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t] - lb[t]) for t in la) < tol


@pytest.mark.parametrize("level", ["scalar", "avx2-16-lanes"])
def test_decode_stack_on_every_kernel_variant(case: tuple[str, Path, Any, LLM], level: str) -> None:
    """The stack built from another variant (the portable one; AVX-512's 16-lane code on AVX2) over the same
    packed weights and cache gives the module path's tokens and logprobs."""
    target.cpu_only()
    from tokenmill import kernels
    from tokenmill.kernels.isa import supported_levels
    from tokenmill.models.decode_stack import DecodeStack

    if level != "scalar" and ("avx2" not in supported_levels() or "avx512" in supported_levels()):
        pytest.skip(f"{level} is the AVX2 build of the 16-lane code: only for an AVX2 CPU without AVX-512")
    _, folder, _, _ = case
    llm = LLM(str(folder), dtype="float32", device="cpu")
    runner = llm.engine.runner
    _skip_without_stack(llm)
    runner.kv.ops = kernels.variant(level)  # type: ignore[attr-defined]
    runner.decode_stack = DecodeStack.build(llm.loaded.model, runner.kv)
    assert runner.decode_stack is not None
    ids = llm.tokenizer.encode(PROMPT)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (5, len(ids))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    stacked = [o.outputs[0] for o in llm.generate(prompts, params)]
    runner.decode_stack = None
    modules = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(stacked, modules):
        assert a.token_ids == b.token_ids
        assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la) < 1e-5


def test_decode_profile_times_every_stage_without_changing_tokens(make_checkpoint: Callable[..., Path]) -> None:
    """DecodeStack.profile (scripts/profile_decode.py): each decode step's run lists every stage of every layer in
    order, then the final norm and the head, back to back within the step's time; the tokens do not change, and
    off it keeps nothing."""
    target.cpu_only()
    import time

    llm = LLM(str(make_checkpoint("llama")), dtype="float32", device="cpu")
    _skip_without_stack(llm)
    stack = llm.engine.runner.decode_stack
    prompt = [{"prompt_token_ids": llm.tokenizer.encode(PROMPT)}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(prompt, params)[0].outputs[0].token_ids
    stack.profile(True)
    start = time.perf_counter()
    profiled = llm.generate(prompt, params)[0].outputs[0].token_ids
    elapsed = time.perf_counter() - start
    runs = stack.stage_runs()
    assert profiled == plain
    assert len(runs) == 5  # the first token comes from the prefill
    layer_kinds = ["input_norm", "qkv_proj", "rope_kv_write", "attention", "o_input", "o_proj", "post_norm",
                   "gate_up_proj", "silu_mul", "down_proj"]  # fmt: skip
    layers = llm.loaded.config.num_layers
    for run in runs:
        assert [k for k, *_ in run] == layer_kinds * layers + ["final_norm", "lm_head"]
        assert [lay for _, lay, *_ in run] == [i // 10 for i in range(10 * layers)] + [None, None]
        assert run[0][2] == 0.0 and all(a[3] == b[2] for a, b in itertools.pairwise(run))
        assert all(end >= start for *_, start, end in run)
    assert sum(run[-1][3] for run in runs) < elapsed
    stack.profile(False)
    llm.generate(prompt, params)
    assert stack.stage_runs() == []


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_decode_stack_with_pair_products_matches_the_module_path(
    make_checkpoint: Callable[..., Path], arch: str
) -> None:
    """A bf16 model's linears multiply the model's bf16 rows in k pairs (vdpbf16ps on AVX-512 BF16,
    kernels/csrc/arch/avx512bf16/pair_tile.h); forced on here, every variant this CPU has feeds each linear of the
    stack its own input rows (qkv bias: Qwen2; q/k norms: Qwen3), with the module path's tokens and, up to bf16
    rounding, logprobs."""
    target.cpu_only()
    from tokenmill import kernels
    from tokenmill.kernels.isa import supported_levels
    from tokenmill.models.decode_stack import DecodeStack

    folder = make_checkpoint(arch, **SPREAD)
    llm = LLM(str(folder), dtype="bfloat16", device="cpu")
    _skip_without_stack(llm)
    runner = llm.engine.runner
    ids = llm.tokenizer.encode(PROMPT)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (4, 9, len(ids))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    runner.decode_stack = None
    modules = [o.outputs[0] for o in llm.generate(prompts, params)]
    for level in supported_levels():
        ops = kernels.variant(level)
        runner.kv.ops = ops  # type: ignore[attr-defined]
        runner.decode_stack = DecodeStack.build(llm.loaded.model, runner.kv)
        for amx in (0, 1) if ops.module.amx_native() else (0,):  # the pair tiles, and AMX's from one row
            previous, amx_before = ops.module.set_bf16_dot(1), ops.module.set_amx(amx)
            try:
                stacked = [o.outputs[0] for o in llm.generate(prompts, params)]
            finally:
                ops.module.set_bf16_dot(previous)
                ops.module.set_amx(amx_before)
            for a, b in zip(stacked, modules):
                assert a.token_ids == b.token_ids, (level, amx)
                drift = max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la)
                assert drift < 0.05, (level, amx)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_stack_on_amx_equals_the_module_path(make_checkpoint: Callable[..., Path], quantization: str) -> None:
    """Q8_0 / Q4_0 linears in the stack read its quantized rows with the stack's own row stride; AMX's int8 tiles
    (forced from one row) and the VNNI tiles give the module path's tokens and logprobs."""
    target.cpu_only()
    from tokenmill import kernels

    folder = make_checkpoint("qwen2", **SPREAD)
    llm = LLM(str(folder), dtype="bfloat16", device="cpu", quantization=quantization)
    _skip_without_stack(llm)
    ops = kernels.active()
    if ops is None or not ops.module.amx_native():
        pytest.skip("no AMX tiles here: the CPU lacks AMX-BF16/INT8, the variant is not avx512bf16, or Linux refused")
    runner = llm.engine.runner
    ids = llm.tokenizer.encode(PROMPT)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (4, 9, len(ids))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    stack, runner.decode_stack = runner.decode_stack, None
    amx_before = ops.module.set_amx(0)
    try:
        modules = [o.outputs[0] for o in llm.generate(prompts, params)]
        runner.decode_stack = stack
        for amx in (0, 1):
            ops.module.set_amx(amx)
            stacked = [o.outputs[0] for o in llm.generate(prompts, params)]
            for a, b in zip(stacked, modules):
                assert a.token_ids == b.token_ids, amx
                assert max(abs(la[t] - lb[t]) for la, lb in zip(a.logprobs, b.logprobs) for t in la) < 0.05, amx
    finally:
        ops.module.set_amx(amx_before)


def test_the_text_tower_of_a_gemma3_multimodal_checkpoint(tokenizer_dir: Path, tmp_path: Path) -> None:
    """`Gemma3ForConditionalGeneration` checkpoints (Gemma 3 4B and up): the text model loads, the vision tower
    is skipped, and text-only logits equal transformers' multimodal model's."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=512, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], initializer_range=0.1)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    torch.manual_seed(0)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=383)
    hf = Gemma3ForConditionalGeneration(config).eval()
    hf.save_pretrained(str(tmp_path))
    hf.to(target.DEVICE)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", device=target.DEVICE)
    assert llm.loaded.config.architecture == "Gemma3ForConditionalGeneration"
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        want = hf(input_ids=target.ids_tensor([ids])).logits[0].float().cpu()
    assert (_full_logits(llm, ids) - want).abs().max().item() < FP32_TOL

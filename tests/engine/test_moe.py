"""A mixture-of-experts model in the engine: batching, chunked prefill, preemption, prefix caching, speculative
decoding and quantized experts leave its greedy output as each request gets alone, and no KV block leaks.

In a batch each expert multiplies the rows routed to it from every request together, so these fail if routing or
the grouping by expert let one request's rows change another's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import target
from tests.engine.test_batching import PARAMS, PROMPTS, assert_pool_full, assert_prefix_hit_keeps_tokens
from tokenmill import LLM, SamplingParams
from tokenmill.models.moe import SparseMoE

MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # sinks, and a window of 8 that the prompts and their outputs run past (layer 0; layer 1 full)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8),
}


@pytest.fixture(scope="module", params=list(MOE))
def folder(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(request.param, initializer_range=0.1, **MOE[request.param])


def _llm(folder: Path, **kwargs: Any) -> LLM:
    return LLM(str(folder), dtype="float32", device=target.DEVICE, **kwargs)


def _run(llm: LLM, prompts: list[list[int]] = PROMPTS, params: list[SamplingParams] = PARAMS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(folder: Path) -> list[list[int]]:
    llm = _llm(folder, enable_prefix_caching=False)
    return [_run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]


def test_every_layer_routes_tokens_to_several_experts(folder: Path) -> None:
    """The checkpoint really is sparse, and its routing spreads one prompt's tokens over the experts (otherwise the
    batching tests below would not test the grouping by expert)."""
    llm = _llm(folder)
    moes = [m for m in llm.loaded.model.modules() if isinstance(m, SparseMoE)]
    assert moes
    chosen: list[set[int]] = []

    def record(module: Any, inputs: Any, output: Any) -> None:  # the layer's routing of its [T, D] input
        chosen.append(set(module.route(inputs[0])[1].flatten().tolist()))

    hooks = [m.register_forward_hook(record) for m in moes]
    _run(llm, PROMPTS[:1], PARAMS[:1])
    for hook in hooks:
        hook.remove()
    assert all(len(experts) >= 3 for experts in chosen[: len(moes)])  # the prompt's step, in every sparse layer


def test_a_batch_chunked_and_preempted_equals_each_request_alone(folder: Path, alone: list[list[int]]) -> None:
    for kwargs in (dict(enable_prefix_caching=False), dict(max_num_batched_tokens=8, enable_prefix_caching=False),
                   dict(num_kv_blocks=12, block_size=8)):  # fmt: skip
        llm = _llm(folder, **kwargs)
        assert _run(llm) == alone, kwargs
        assert_pool_full(llm.engine)
    assert llm.engine.stats.num_preemptions > 0


def test_a_prefix_cache_hit_gives_the_same_tokens(folder: Path) -> None:
    assert_prefix_hit_keeps_tokens(_llm(folder))


def test_ngram_speculation_keeps_greedy_output(folder: Path) -> None:
    prompts = [p * 3 for p in PROMPTS[:6]]  # repeats, so the n-gram proposer finds drafts
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(prompts)
    plain = _run(_llm(folder), prompts, params)
    spec = _llm(folder, speculative_model="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=64)
    assert _run(spec, prompts, params) == plain
    assert spec.engine.stats.spec_draft_tokens > 0 and spec.engine.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("dtype, quantization", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int4"),
                                                  ("float32", "q4_k_m")])  # fmt: skip
def test_the_decode_stack_runs_sparse_layers_with_the_modules_bits(folder: Path, dtype: str, quantization: str) -> None:
    """Decode steps and decode runs of a MoE model go through the decode stack (stack/moe.h: each row's router, the
    chosen experts over their rows, the weighted sums; gpt-oss's sinks, window, biases and clamped SwiGLU) and give
    the module path's tokens, and its logprobs as the dense stack does, in a batch whose rows choose different experts
    as well as one row alone."""
    target.cpu_only("the CPU kernels")
    llm = LLM(str(folder), dtype=dtype, quantization=quantization, num_scheduler_steps=1)
    runner = llm.engine.runner
    if llm.loaded.ops is None:
        pytest.skip("no compiled CPU kernels here: the decode stack needs them")
    assert runner.decode_stack is not None
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run() -> list[Any]:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)] + [
            (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts[:1], params)]  # fmt: skip

    stack = runner.decode_stack
    stack.profile(True)
    stacked = run()
    kinds = {kind for run in stack.stage_runs() for kind, *_ in run}
    stack.profile(False)
    assert {"post_norm_route", "experts_gate_up", "experts_silu", "experts_down"} <= kinds
    runner.decode_stack = None
    tol = 1e-5 if dtype == "float32" else 0.05  # as the dense stack's (its sums' order, not the routing)
    for (tokens, logprobs), (want, want_logprobs) in zip(stacked, run(), strict=True):
        assert tokens == want
        assert max(abs(a[t] - b[t]) for a, b in zip(logprobs, want_logprobs) for t in a) < tol
    runner.decode_stack = stack
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runs = LLM(str(folder), dtype=dtype, quantization=quantization, num_scheduler_steps=4)
    assert runs.engine.runner.runs_decode_steps
    assert [o.outputs[0].token_ids for o in runs.generate(prompts, params)] == greedy
    assert_pool_full(runs.engine)


@pytest.mark.parametrize(("dtype", "quantization"), [("bfloat16", "none"), ("bfloat16", "int8"), ("float32", "q4_k")])
def test_the_decode_stack_runs_experts_of_many_rows_as_the_modules(
    make_checkpoint: Callable[..., Path], dtype: str, quantization: str
) -> None:
    """16 rows, two experts and both chosen: every expert multiplies all 16 rows in the decode stack's expert stages,
    past the row count where a CPU with AMX takes its tiles (9), and the tokens and logprobs are the module path's."""
    target.cpu_only("the CPU kernels")
    shape = dict(num_experts=2, num_experts_per_tok=2, norm_topk_prob=True, hidden_size=256, moe_intermediate_size=256,
                 head_dim=32)  # fmt: skip
    folder = make_checkpoint("qwen3_moe", initializer_range=0.1, **shape)
    llm = LLM(str(folder), dtype=dtype, quantization=quantization, num_scheduler_steps=1, max_num_seqs=16)
    runner = llm.engine.runner
    if llm.loaded.ops is None:
        pytest.skip("no compiled CPU kernels here: the decode stack needs them")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:16]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run() -> list[Any]:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    stack = runner.decode_stack
    assert stack is not None
    stack.profile(True)
    stacked = run()
    kinds = {kind for run in stack.stage_runs() for kind, *_ in run}
    stack.profile(False)
    assert {"experts_gate_up", "experts_down"} <= kinds
    assert llm.engine.stats.max_batch_size == 16  # (the steps' rows: all 16 prompts decode together)
    runner.decode_stack = None
    tol = 1e-5 if dtype == "float32" else 0.05
    for (tokens, logprobs), (want, want_logprobs) in zip(stacked, run(), strict=True):
        assert tokens == want
        assert max(abs(a[t] - b[t]) for a, b in zip(logprobs, want_logprobs) for t in a) < tol
    runner.decode_stack = stack


@pytest.mark.parametrize("quantization", ["int8", "q4_k_m"])
def test_quantized_experts_keep_their_format_and_batch_invariance(folder: Path, quantization: str) -> None:
    """Every expert's linears take the format (the router stays in float); a batch still equals each alone."""
    target.cpu_only("the CPU kernels' formats")
    from tokenmill.models.linear import KernelLinear

    llm = _llm(folder, quantization=quantization)
    moe = next(m for m in llm.loaded.model.modules() if isinstance(m, SparseMoE))
    assert all(isinstance(e.gate_up_proj, KernelLinear) for e in moe.experts)
    assert not isinstance(moe.gate, KernelLinear)
    prompts, params = PROMPTS[:8], PARAMS[:8]
    each = [_run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert _run(llm, prompts, params) == each


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("quantization", "hidden"), [("none", 64), ("int8", 64), ("int4", 64), ("none", 68)])
def test_one_kernel_call_for_all_experts_gives_each_experts_bits(
    make_checkpoint: Callable[..., Path], dtype: str, quantization: str, hidden: int
) -> None:
    """linear/experts.h runs a layer's chosen experts in one call, their chunks across threads; each expert's rows
    come out bit for bit as its own modules give them, at one row per expert (decode) and at many (a prefill).
    Its buffers outlive a call: a smaller call after a larger one finds the larger one's bytes in them, and after
    they are released the next call makes new ones. A hidden size of 68 leaves a tail past the vector lanes."""
    target.cpu_only("the CPU kernels")
    import torch

    shape = dict(MOE["qwen3_moe"], hidden_size=hidden, head_dim=16)
    folder = make_checkpoint("qwen3_moe", initializer_range=0.1, **shape)
    llm = LLM(str(folder), dtype=dtype, quantization=quantization)
    moe = next(m for m in llm.loaded.model.modules() if isinstance(m, SparseMoE))
    if llm.loaded.ops is None:
        pytest.skip("no compiled CPU kernels here")
    torch.manual_seed(0)
    for tokens in (1, 3, 40, 5, None, 2):
        if tokens is None:
            llm.loaded.model.release_scratch()
            continue
        x = torch.randn(tokens, llm.loaded.config.hidden_size).to(getattr(torch, dtype))
        with torch.inference_mode():
            moe._experts_call = None
            fused = moe(x)
            assert moe._experts_call, "the one-call path was not taken"
            moe._experts_call = ()
            each = moe(x)
        assert torch.equal(fused, each), tokens


@pytest.mark.parametrize("quantization", ["none", "int4", "q4_k_m"])
def test_the_expert_kernel_on_every_variant_this_cpu_runs(
    make_checkpoint: Callable[..., Path], quantization: str
) -> None:
    """Each ISA variant's one-call experts (scalar, AVX2, AVX-VNNI, AVX-512, AVX-512 BF16, as this CPU has them) give
    the bits of that variant's per-expert modules (K-quants need rows of 256: a wide model)."""
    target.cpu_only("the CPU kernels")
    import torch

    from tokenmill import kernels
    from tokenmill.kernels.isa import supported_levels
    from tokenmill.models.linear import KernelLinear

    wide = dict(MOE["qwen3_moe"], hidden_size=256, moe_intermediate_size=256)
    llm = LLM(str(make_checkpoint("qwen3_moe", initializer_range=0.1, **wide)), dtype="float32",
              quantization=quantization)  # fmt: skip
    if llm.loaded.ops is None:
        pytest.skip("no compiled CPU kernels here")
    moe = next(m for m in llm.loaded.model.modules() if isinstance(m, SparseMoE))
    linears = [m for m in moe.experts.modules() if isinstance(m, KernelLinear)]
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(0))
    for level in supported_levels():
        for m in [*linears, *moe.experts]:  # the linears, and the SiLU*mul between them
            m.ops = kernels.variant(level)
        with torch.inference_mode():
            moe._experts_call = None
            fused = moe(x)
            assert moe._experts_call, level
            moe._experts_call = ()
            each = moe(x)
        assert torch.equal(fused, each), level


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_router_picks_torchs_experts_ties_included(dtype: str) -> None:
    """ops/route.h (the router of the module path and of the decode stack) against torch's softmax and topk: the same
    experts in the same order, ties included (twin router rows tie exactly), and the same weights up to the sums'
    order, for top-k taken both ways torch takes it (k * 64 <= E or not), on each ISA variant this CPU runs."""
    target.cpu_only("the CPU kernels")
    import torch
    import torch.nn.functional as F

    from tokenmill import kernels
    from tokenmill.kernels.isa import supported_levels

    if kernels.variant(supported_levels()[0]) is None:
        pytest.skip("no compiled CPU kernels here")
    gen = torch.Generator().manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    for experts, k, renorm in ((8, 2, False), (60, 4, True), (128, 2, True)):
        router = torch.randn(experts, 64, generator=gen)
        router[1::3] = router[0::3][: len(router[1::3])]  # twins: equal logits, equal weights
        router = router.to(torch_dtype)
        x = torch.randn(48, 64, generator=gen).to(torch_dtype)
        probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)  # [T, E]
        want, want_ids = torch.topk(probs, k, dim=-1)  # [T, k]
        if renorm:
            want = want / want.sum(dim=-1, keepdim=True)
        for level in supported_levels():
            ids, weights = torch.empty(48, k, dtype=torch.int64), torch.empty(48, k)
            module = kernels.variant(level).module
            module.moe_route(x.data_ptr(), dtype == "bfloat16", 48, 64, router.data_ptr(), experts, k, renorm, False,
                             ids.data_ptr(), weights.data_ptr(), 0, False)  # fmt: skip
            assert torch.equal(ids, want_ids), (experts, k, level)
            close = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=0, atol=4e-3)  # bf16: an ulp
            assert torch.allclose(weights, want.to(torch_dtype).float(), **close), (experts, k, level)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_router_routes_as_gpt_oss_ties_included(dtype: str) -> None:
    """ops/route.h as gpt-oss's router (GptOssTopKRouter, which the decode stack runs too): the biased logits' top k,
    then their softmax in the model dtype; the same experts in torch.topk's order, ties included, on each ISA variant
    this CPU runs."""
    target.cpu_only("the CPU kernels")
    import torch
    import torch.nn.functional as F

    from tokenmill import kernels
    from tokenmill.kernels.isa import supported_levels

    if kernels.variant(supported_levels()[0]) is None:
        pytest.skip("no compiled CPU kernels here")
    gen = torch.Generator().manual_seed(1)
    torch_dtype = getattr(torch, dtype)
    for experts, k in ((8, 2), (32, 4), (128, 2)):
        router, bias = torch.randn(experts, 64, generator=gen), torch.randn(experts, generator=gen)
        router[1::3], bias[1::3] = router[0::3][: len(router[1::3])], bias[0::3][: len(bias[1::3])]  # twins
        router, bias = router.to(torch_dtype), bias.to(torch_dtype)
        x = torch.randn(48, 64, generator=gen).to(torch_dtype)
        top, want_ids = torch.topk(F.linear(x, router, bias), k, dim=-1)  # [T, k]
        want = torch.softmax(top, dim=-1, dtype=torch_dtype).float()
        for level in supported_levels():
            ids, weights = torch.empty(48, k, dtype=torch.int64), torch.empty(48, k)
            kernels.variant(level).module.moe_route(x.data_ptr(), dtype == "bfloat16", 48, 64, router.data_ptr(),
                                                    experts, k, False, False, ids.data_ptr(), weights.data_ptr(),
                                                    bias.data_ptr(), True)  # fmt: skip
            assert torch.equal(ids, want_ids), (experts, k, level)
            close = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=0, atol=4e-3)  # bf16: an ulp
            assert torch.allclose(weights, want, **close), (experts, k, level)


def test_a_decode_steps_weight_bytes_count_the_chosen_experts_only(folder: Path) -> None:
    """What the benchmarks judge a MoE decode's GB/s by (models/linear.py: weight_bytes): the dense weights and, of
    each sparse layer's experts, the top_k of num_experts a token chooses; never the embedding table."""
    from tokenmill.models.linear import weight_bytes

    llm = _llm(folder)
    model, moe_cfg = llm.loaded.model, llm.loaded.config.moe
    assert moe_cfg is not None

    def size(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    experts = {id(t) for m in moes for t in [*m.experts.parameters(), *m.experts.buffers()]}
    embedding = {id(t) for t in model.decoder().embed_tokens.parameters()} - {id(t) for t in model.lm_head.parameters()}
    dense = size(t for t in [*model.parameters(), *model.buffers()] if id(t) not in experts | embedding)
    per_layer = size([*moes[0].experts.parameters(), *moes[0].experts.buffers()])
    assert per_layer > 0 and weight_bytes(model) == dense + len(moes) * (
        per_layer * moe_cfg.top_k // moe_cfg.num_experts
    )


def test_the_engines_memory_counts_every_expert(folder: Path) -> None:
    """What the start-up log states and a server's --models-memory-gb budget counts (engine/footprint.py) is the
    memory the weights take: every expert, not the share a token reads."""
    from tokenmill.engine.footprint import model_bytes

    llm = _llm(folder)
    tensors = {id(t): t for t in [*llm.loaded.model.parameters(), *llm.loaded.model.buffers()]}  # each once
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    weights, pool = model_bytes(llm.loaded, llm.engine)
    assert weights == held and pool > 0, (weights, held)

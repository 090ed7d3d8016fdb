"""LoRA adapters against transformers + peft's `PeftModel` on tiny random checkpoints and adapters made here.

peft writes each adapter with random non-zero B (`init_lora_weights=False`), so the update changes the logits. For
each: float32 logits over a prompt within 1e-4 of PeftModel's, and greedy tokens equal to its `generate`; a batch
mixing four adapters and the base model gives each prompt what it gets alone; an int8 base with an adapter equals
the dequantized base with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import target
from tests.lora_adapters import make_adapter
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.attention import causal
from tokenmill.models.lora import LoraBatch

peft = pytest.importorskip("peft", reason="peft (the dev extra) makes the reference adapters")

FP32_TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTN, "gate_proj", "up_proj", "down_proj"]
# (targets, rank, alpha, rsLoRA): every projection, attention only, a few shards of the fused ones, rsLoRA
ADAPTERS: dict[str, tuple[list[str], int, int, bool]] = {
    "all-r8": (ALL, 8, 16, False),
    "attn-r4": (ATTN, 4, 8, False),
    "qv-down-r2": (["q_proj", "v_proj", "down_proj"], 2, 4, False),
    "up-k-r16-rslora": (["k_proj", "up_proj"], 16, 8, True),
}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen2", initializer_range=0.1)


@pytest.fixture(scope="module")
def adapters(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(checkpoint, folder / name, *spec, seed=i)
            for i, (name, spec) in enumerate(ADAPTERS.items())}  # fmt: skip


@pytest.fixture(scope="module")
def llm(checkpoint: Path, adapters: dict[str, Path]) -> LLM:
    return LLM(str(checkpoint), dtype="float32", device=target.DEVICE, max_lora_rank=16,
               lora_modules={name: str(path) for name, path in adapters.items()})  # fmt: skip


def _peft(checkpoint: Path, adapter: Path) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


def _greedy(ref: Any, ids: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens of the reference, EOS included (as `ignore_eos`): the whole context each step."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def _our_logits(llm: LLM, name: str | None, ids: list[int]) -> torch.Tensor:  # [T, V] float32, on the CPU
    """The whole prompt through the model's modules, every row with adapter `name` (None: the base model)."""
    loras = llm.engine.runner.lora
    assert loras is not None and llm.engine.lora is not None
    model = llm.loaded.model
    if name is not None:
        loras.state.batch = LoraBatch([(llm.engine.lora.get(name).adapter_id, slice(None))])
    try:
        with torch.inference_mode():
            hidden = model(target.ids_tensor(ids), target.positions(0, len(ids)), *causal(len(ids)))
            return model.compute_logits(hidden).float().cpu()
    finally:
        loras.state.batch = None


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_logits_and_greedy_tokens_match_peft(
    llm: LLM, checkpoint: Path, adapters: dict[str, Path], name: str
) -> None:
    ref = _peft(checkpoint, adapters[name])
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()  # [T, V]
        base = ref.get_base_model()
        with ref.disable_adapter():
            base_logits = base(torch.tensor([ids])).logits[0].float()
    ours = _our_logits(llm, name, ids)
    assert (expected - base_logits).abs().max().item() > 1e-2, "the adapter must change the logits"
    assert (ours - expected).abs().max().item() < FP32_TOL
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       lora_request=name)  # fmt: skip
    assert list(out[0].outputs[0].token_ids) == _greedy(ref, ids, 24)


PHI3_FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize(("arch", "targets", "extra"), [("llama", ALL, {}), ("phi3", PHI3_FUSED, {}),
                                                        ("mixtral", ATTN, MIXTRAL)])  # fmt: skip
def test_other_families_match_peft(
    make_checkpoint: Callable[..., Path], tmp_path: Path, arch: str, targets: list[str], extra: dict[str, Any]
) -> None:
    """Llama's separate projections, Phi-3's fused ones as its checkpoints (and so peft) name them, and the attention
    of a mixture of experts."""
    checkpoint = make_checkpoint(arch, initializer_range=0.1, **extra)
    adapter = make_adapter(checkpoint, tmp_path / "a", targets, 4, 8, seed=7)
    llm = LLM(str(checkpoint), dtype="float32", device=target.DEVICE, lora_modules={"a": str(adapter)})
    ref = _peft(checkpoint, adapter)
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    assert (_our_logits(llm, "a", ids) - expected).abs().max().item() < FP32_TOL
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       lora_request="a")  # fmt: skip
    assert list(out[0].outputs[0].token_ids) == _greedy(ref, ids, 12)


def test_the_prefix_cache_never_shares_kv_across_adapters(
    checkpoint: Path, adapters: dict[str, Path], llm: LLM
) -> None:
    """A long prompt run on the base model, then with an adapter, then with it again: the adapter's run equals peft's
    (no base blocks taken), and its second run hits its own cached blocks."""
    prompt = " ".join(["the cat sat on the mat and looked at the dog"] * 4)
    ids = llm.tokenizer.encode(prompt)
    assert len(ids) > 2 * 16  # two full blocks at least
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], params)
    hits = llm.engine.kv.prefix_cache_hits
    first = llm.generate([{"prompt_token_ids": ids}], params, lora_request="attn-r4")[0]
    assert llm.engine.kv.prefix_cache_hits == hits  # the base model's blocks are not the adapter's
    assert list(first.outputs[0].token_ids) == _greedy(_peft(checkpoint, adapters["attn-r4"]), ids, 8)
    second = llm.generate([{"prompt_token_ids": ids}], params, lora_request="attn-r4")[0]
    assert llm.engine.kv.prefix_cache_hits > hits
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_base_rows_are_untouched_by_loaded_adapters(llm: LLM, checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    assert (_our_logits(llm, None, ids) - expected).abs().max().item() < FP32_TOL


def test_a_batch_mixing_four_adapters_and_the_base_equals_each_alone(llm: LLM) -> None:
    """Four adapters and the base model, an adapter's rows apart from each other (its rows then go by index, not as
    one slice), against each prompt run alone."""
    prompts = ["Once upon a time", "To be or not to be", "The rain in Spain", "All happy families", "In the beginning",
               "It was the best of times", "Call me Ishmael"]  # fmt: skip
    loras: list[str | None] = [*ADAPTERS, None, "all-r8", "qv-down-r2"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    together = llm.generate(prompts, params, lora_request=loras)
    for prompt, lora, mixed in zip(prompts, loras, together, strict=True):
        alone = llm.generate([prompt], params, lora_request=lora)[0].outputs[0]
        assert mixed.outputs[0].token_ids == alone.token_ids, lora
        for a, b in zip(mixed.outputs[0].logprobs or [], alone.logprobs or [], strict=True):
            for token, lp in b.items():
                assert abs(a[token] - lp) < 1e-4
    differs = {tuple(o.outputs[0].token_ids) for o in llm.generate([prompts[0]] * 7, params, lora_request=loras)}
    assert len(differs) > 1, "adapters must change what the same prompt generates"


def test_a_decode_step_with_an_adapter_row_takes_the_path_of_base_rows(llm: LLM) -> None:
    """The decode stack applies adapters: a step with an adapter row takes the path a step of base rows takes, and
    an adapter's sequence is granted decode runs (several steps in one call) as a base one is."""
    from tokenmill.forward import flatten
    from tokenmill.outputs import RequestMetrics
    from tokenmill.step_plan import plan_step, run_steps_allowed
    from tokenmill.types import Request, SequenceInput

    runner, adapter_id = llm.engine.runner, llm.engine.lora.get("all-r8").adapter_id  # type: ignore[union-attr]
    base = [SequenceInput("a", [5], 3, [0], 64, None), SequenceInput("b", [6], 3, [1], 64, None)]
    mixed = [base[0], SequenceInput("b", [6], 3, [1], 64, None, lora_id=adapter_id)]
    plain, with_adapter = plan_step(base, ()), plan_step(mixed, ())
    assert not plain.lora and with_adapter.lora and with_adapter.decode_only
    fast = runner.path_for(plain, flatten(base)).name
    assert runner.path_for(with_adapter, flatten(mixed)).name == fast
    assert fast == ("modules" if runner.decode_stack is None else "decode_stack")
    req = Request("r", "r", 0, [1, 2, 3], SamplingParams(temperature=0), 16, frozenset(), RequestMetrics(0.0),
                  lora_id=adapter_id)  # fmt: skip
    req.output_token_ids, req.num_computed_tokens = [4], 3
    assert run_steps_allowed(req, 4, 64, False) == 4
    if runner.decode_stack is not None:
        run = plan_step(mixed, (), num_steps=4)
        assert runner.run_path is not None and runner.run_path.supports(run, flatten(mixed))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_stack_applies_adapters_as_the_modules_do(
    checkpoint: Path, adapters: dict[str, Path], dtype: str
) -> None:
    """Adapter rows decoded in the stack (several rows mixing adapters and the base; one row alone: its SiLU in
    parts, the qkv update before RoPE) get the module path's tokens and logprobs, bit for bit; a slot past the
    stack's tables is refused before anything runs."""
    target.cpu_only()
    llm = LLM(str(checkpoint), dtype=dtype, device="cpu", max_lora_rank=16,
              lora_modules={name: str(path) for name, path in adapters.items()})  # fmt: skip
    runner = llm.engine.runner
    if runner.decode_stack is None:
        pytest.skip("no decode stack here (no CPU kernels for this model or machine)")
    prompts = ["Once upon a time", "To be or not to be", "The rain in Spain", "Call me Ishmael"]
    loras: list[str | None] = ["all-r8", None, "up-k-r16-rslora", "qv-down-r2"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)

    def run(path: str, params: SamplingParams = params) -> list[Any]:
        together = llm.generate(prompts, params, lora_request=loras)
        alone = llm.generate(prompts[:1], params, lora_request=loras[:1])
        for o in [*together, *alone]:  # the prompt's step on the modules, the decode steps on `path` (a decode
            steps = o.metrics.forward_steps if o.metrics is not None else {}  # run's first step: a single one)
            allowed = {"modules", path} | ({"decode_stack"} if path == "decode_run" else set())
            assert path in steps and set(steps) <= allowed, steps
            assert steps["modules"] == 1 or path == "modules", steps
        return [o.outputs[0] for o in [*together, *alone]]

    stack = runner.decode_stack
    # without logprobs (which keep a row out of them) the decode steps go in decode runs, where the engine has them
    runs = run("decode_run" if llm.engine.scheduler_steps > 1 else "decode_stack", replace(params, logprobs=None))
    stacked = run("decode_stack")
    assert stack.loras is not None and stack._lora_version == llm.engine.runner.lora.version  # type: ignore[union-attr]
    runner.decode_stack = None
    modules = run("modules")
    for a, b, c in zip(stacked, modules, runs, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == b.logprobs
    with pytest.raises(IndexError, match="LoRA slot 9 of row 0"):
        stack.native.set_lora_rows(torch.tensor([9]), 1)
    stack.native.set_lora_rows(None, 0)


@pytest.mark.parametrize("speculator", ["ngram", "draft-model"])
def test_speculation_leaves_adapter_rows_greedy_tokens_unchanged(
    llm: LLM, checkpoint: Path, adapters: dict[str, Path], speculator: str
) -> None:
    """Drafts (prompt lookup, or a draft model: here the base checkpoint, which proposes without the adapters)
    verified with each row's adapter: a batch mixing adapters and the base gets the greedy tokens it gets without
    speculation, and the verifying steps with adapter rows take the decode stack where the model has one."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 4 + [5]}, {"prompt_token_ids": [11, 12, 13] * 5 + [11]},
               {"prompt_token_ids": [21, 22, 23, 24] * 4 + [21]}]  # fmt: skip
    loras: list[str | None] = ["all-r8", None, "qv-down-r2"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    spec = LLM(str(checkpoint), dtype="float32", device=target.DEVICE, max_lora_rank=16,
               lora_modules={name: str(path) for name, path in adapters.items()},
               speculative_model="ngram" if speculator == "ngram" else str(checkpoint))  # fmt: skip
    got = spec.generate(prompts, params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == want
    metrics = [o.metrics for o in got if o.metrics is not None]
    assert len(metrics) == len(prompts) and all(m.num_draft_tokens > 0 for m in metrics), "every row had drafts"
    if spec.engine.runner.decode_stack is not None:
        assert all("decode_stack" in m.forward_steps for m in metrics), [m.forward_steps for m in metrics]


def test_a_lora_request_loads_its_folder_once(checkpoint: Path, adapters: dict[str, Path]) -> None:
    llm = LLM(str(checkpoint), dtype="float32", device=target.DEVICE, enable_lora=True)
    request = LoRARequest("late", 1, str(adapters["attn-r4"]))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(["Hello there"], params, lora_request=request)
    again = llm.generate(["Hello there"], params, lora_request=request)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert llm.engine.lora is not None and llm.engine.lora.names == ("late",)
    llm.unload_lora("late")
    with pytest.raises(ValueError, match="no LoRA adapter named 'late'"):
        llm.generate(["Hello there"], params, lora_request="late")


@pytest.mark.parametrize("quantization", ["int8", "int4", "q4_k"])
def test_a_quantized_base_with_an_adapter_equals_the_dequantized_base_with_it(
    checkpoint: Path, adapters: dict[str, Path], quantization: str
) -> None:
    """The update runs beside the quantized linears: the same adapter over the quantized model agrees with peft over
    that model's own dequantized weights as closely as the quantized base alone agrees with that base (the kernels
    also round each activation row to 8 bits, which no float32 reference does), and the adapter moves the logits by
    far more."""
    q = LLM(str(checkpoint), dtype="float32", device=target.DEVICE, quantization=quantization,
            lora_modules={"a": str(adapters["all-r8"])})  # fmt: skip
    ids = q.tokenizer.encode(PROMPT)
    with_adapter, base = _our_logits(q, "a", ids), _our_logits(q, None, ids)
    ref = _peft(checkpoint, adapters["all-r8"])
    _load_dequantized(ref.get_base_model(), q)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
        with ref.disable_adapter():
            expected_base = ref(torch.tensor([ids])).logits[0].float()
    base_error = (base - expected_base).abs().max().item()
    error = (with_adapter - expected).abs().max().item()
    moved = (expected - expected_base).abs().max().item()
    print(f"{quantization} + adapter: error {error:.4f}, the base's own {base_error:.4f}, moved {moved:.4f}")
    assert error <= 2 * base_error + 1e-4
    assert moved > 10 * error


def _load_dequantized(hf: Any, llm: LLM) -> None:
    """Put our int8 model's dequantized weights into the transformers model (its q/k/v, gate/up split back)."""
    from tokenmill.kernels import formats

    def dequantized_weight(linear: Any) -> torch.Tensor:  # [N, K] float32
        return formats.unpack(linear.packed())

    sd = hf.state_dict()
    for i, layer in enumerate(llm.loaded.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = dequantized_weight(attn.qkv_proj).float()
        q_size, kv = attn.q_size, attn.kv_size
        parts = {"self_attn.q_proj": qkv[:q_size], "self_attn.k_proj": qkv[q_size : q_size + kv],
                 "self_attn.v_proj": qkv[q_size + kv :], "self_attn.o_proj": dequantized_weight(attn.o_proj).float(),
                 "mlp.gate_proj": dequantized_weight(mlp.gate_up_proj).float()[: mlp.intermediate_size],
                 "mlp.up_proj": dequantized_weight(mlp.gate_up_proj).float()[mlp.intermediate_size :],
                 "mlp.down_proj": dequantized_weight(mlp.down_proj).float()}  # fmt: skip
        for name, w in parts.items():
            key = next(k for k in sd if k.endswith(f"layers.{i}.{name}.base_layer.weight") or
                       k.endswith(f"layers.{i}.{name}.weight"))  # fmt: skip
            sd[key].copy_(w)
    head = llm.loaded.model.lm_head
    sd[next(k for k in sd if k.endswith("lm_head.weight"))].copy_(dequantized_weight(head).float())

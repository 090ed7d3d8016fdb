"""Speculative decoding, with prompt lookup and with a draft model: greedy output is token for token the same,
sampling keeps the target's distribution (a chi-square test that a broken acceptance rule fails), and the KV
pools come back whole after any mix of kept and rejected drafts, aborts and preemptions."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.attention import causal
from tokenmill.spec_decode import NgramProposer
from tokenmill.types import EngineRequest

rng = random.Random(0)
# repeated segments: text grounded in its own prompt, where prompt lookup finds drafts
PROMPTS = [
    (seg := [rng.randrange(3, 384) for _ in range(rng.randrange(3, 12))]) * 3 + [rng.randrange(3, 384)] * (i % 3)
    for i in range(12)
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
# drafts for every running sequence (the default switches them off above 4)
SPEC: dict[str, Any] = dict(speculative_model="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=64)


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", initializer_range=0.1)


def _run(folder: Path, prompts: list[list[int]], params: SamplingParams, **engine: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks  # every block back, drafts' lookahead slots included
    return llm, [o.outputs for o in outs]


def test_the_proposer_finds_the_latest_longest_match() -> None:
    p = NgramProposer(3, n_min=1, n_max=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]  # the most recent "1 2 3" wins
    assert p.propose([5, 1, 2, 6, 2]) == [6, 2]  # only "2" matches: what follows it, up to the end
    assert p.propose([1, 2, 3, 4, 1, 2], limit=1) == [3]
    assert p.propose([1, 2, 3, 4]) == []  # the suffix occurs nowhere earlier
    assert NgramProposer(3, n_min=2, n_max=2).propose([1, 2, 3, 4, 2]) == []  # "4 2" never occurred
    with pytest.raises(ValueError, match="min <= max"):
        NgramProposer(3, n_min=3, n_max=2)


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"max_num_batched_tokens": 16, "enable_prefix_caching": True},  # drafts compete with chunked prefills
        {"cpu_kernels": False},
        {"kv_cache": "contiguous"},
        {"num_kv_blocks": 20, "block_size": 4},  # preemption by recompute
    ],
    ids=["batched", "chunked", "no-kernels", "contiguous", "preempted"],
)
def test_greedy_output_is_token_for_token_the_same(folder: Path, engine: dict[str, Any]) -> None:
    _, want = _run(folder, PROMPTS, GREEDY, **engine)
    llm, got = _run(folder, PROMPTS, GREEDY, **engine, **SPEC)
    assert llm.engine.stats.spec_accepted_tokens > 0  # drafts were kept, so the check means something
    for w, g in zip(want, got):
        assert g[0].token_ids == w[0].token_ids
        for i, token in enumerate(w[0].token_ids):  # the kept tokens' logprobs are the target's
            assert abs(g[0].logprobs[i][token] - w[0].logprobs[i][token]) < 1e-4


def test_stop_strings_n_and_prefix_hits_land_where_they_would(folder: Path) -> None:
    base = LLM(str(folder), dtype="float32", device=target.DEVICE)
    text = base.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string in the middle of the output
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], n=2)
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[2]]  # the second one hits the prefix cache
    _, want = _run(folder, prompts, params)
    _, got = _run(folder, prompts, params, **SPEC)
    assert [[c.text for c in o] for o in got] == [[c.text for c in o] for o in want]
    assert [[c.finish_reason for c in o] for o in got] == [[c.finish_reason for c in o] for o in want]


def test_kept_drafts_past_a_stop_string_leave_nothing_behind() -> None:
    """Drafts kept past the token that completes a stop string are dropped with all they left: the same tokens,
    text, logprobs, cumulative logprob and token count as without drafts, for stop strings ending at many places
    of the output. The demo model and its draft, whose drafts are often kept."""
    base = LLM(device=target.DEVICE)
    spec = LLM(device=target.DEVICE, speculative_model="demo-draft", num_speculative_tokens=3)
    prompt = ["ROMEO:"]
    text = base.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    for needle in sorted({text[i : i + 2] for i in range(len(text) - 1) if text[i : i + 2].strip()}):
        params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, stop=[needle])
        want, got = base.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        w, g = want.outputs[0], got.outputs[0]
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (w.text, w.token_ids, "stop", needle)
        assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids)
        assert g.cumulative_logprob is not None and w.cumulative_logprob is not None
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3, needle
        assert got.metrics is not None and got.metrics.num_generated_tokens == len(g.token_ids), needle
    assert spec.engine.stats.spec_accepted_tokens > 0


def test_auto_off_above_a_batch_size(folder: Path) -> None:
    busy, _ = _run(folder, PROMPTS[:4], GREEDY, **{**SPEC, "speculative_disable_by_batch_size": 3})
    assert busy.engine.stats.spec_draft_tokens == 0  # four run together, all the way
    alone, _ = _run(folder, PROMPTS[:1], GREEDY, **{**SPEC, "speculative_disable_by_batch_size": 3})
    assert alone.engine.stats.spec_draft_tokens > 0


def test_waiting_sequences_count_towards_auto_off(folder: Path) -> None:
    """Two run at a time (max_num_seqs) while two wait: four in all, over the limit of 3, so the first two get no
    drafts; the last two run with nobody waiting and get them. Greedy output is the same either way."""
    _, want = _run(folder, PROMPTS[:4], GREEDY)
    llm = LLM(
        str(folder),
        dtype="float32",
        device=target.DEVICE,
        max_num_seqs=2,
        **{**SPEC, "speculative_disable_by_batch_size": 3},
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [w[0].token_ids for w in want]
    drafted = [o.metrics.num_draft_tokens for o in outs if o.metrics is not None]
    assert drafted[:2] == [0, 0] and all(d > 0 for d in drafted[2:]) and len(drafted) == 4, drafted


def test_bad_settings_are_one_clear_error(folder: Path, tmp_path: Path) -> None:
    from tokenmill.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"^speculative_model=.*draft.gguf.*: model file .* does not exist"):
        LLM(str(folder), dtype="float32", device=target.DEVICE, speculative_model=str(tmp_path / "draft.gguf"))
    with pytest.raises(ValueError, match="needs a KV cache"):
        LLM("x", speculative_model="ngram", kv_cache="none")
    with pytest.raises(ValueError, match="ngram_prompt_lookup_min=3 exceeds"):
        LLM("x", speculative_model="ngram", ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2)


# -- lossless sampling -----------------------------------------------------------------------------------------
TOP_K = 3
DRAWS = 900
CHI2_DF8_P001 = 26.12  # the chi-square distribution's 0.999 quantile at 8 degrees of freedom


def _pair_distribution(llm: LLM, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The exact probability of each (first, second) output pair under temperature 1 and top-k."""
    model = llm.loaded.model

    def top(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        with torch.inference_mode():
            logits = model.compute_logits(
                model(target.ids_tensor(ids), target.positions(0, len(ids)), *causal(len(ids)))
            )[-1]
        values, tokens = logits.topk(TOP_K)
        return tokens.tolist(), values.softmax(-1)

    firsts, p1 = top(prompt)
    dist = {}
    for a, pa in zip(firsts, p1.tolist()):
        seconds, p2 = top([*prompt, a])
        for b, pb in zip(seconds, p2.tolist()):
            dist[a, b] = pa * pb
    return dist


def _chi_square(folder: Path, prompt: list[int], **engine: Any) -> float:
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE, max_num_seqs=64, **engine)
    dist = _pair_distribution(llm, prompt)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, seed=i, ignore_eos=True) for i in range(DRAWS)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * DRAWS, params)
    counts = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)
    if not set(counts) <= set(dist):
        return math.inf  # a pair the target gives probability 0
    return sum((counts[pair] - DRAWS * p) ** 2 / (DRAWS * p) for pair, p in dist.items())


def test_sampling_keeps_the_target_distribution_and_a_broken_rule_fails(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every token id occurs in the prompt, so after any first token prompt lookup drafts a second one; the
    (first, second) pairs of seeded draws must follow the target's exact distribution."""
    prompt = list(range(3, 384))
    random.Random(1).shuffle(prompt)
    plain = _chi_square(folder, prompt)
    spec = _chi_square(folder, prompt, **SPEC)
    assert plain < CHI2_DF8_P001 and spec < CHI2_DF8_P001, (plain, spec)
    monkeypatch.setattr("tokenmill.sampling.drafts.accepts_draft", lambda sampled, draft: True)  # keep every draft
    broken = _chi_square(folder, prompt, **SPEC)
    assert broken > CHI2_DF8_P001, broken  # the test can fail: it does on the broken rule


# -- KV integrity ----------------------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    aborts=st.lists(st.integers(0, 7), max_size=3),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_the_pool_comes_back_whole(folder: Path, seed: int, aborts: list[int], temperature: float) -> None:
    r = random.Random(seed)
    llm = LLM(str(folder), dtype="float32", device=target.DEVICE, num_kv_blocks=24, block_size=4, **SPEC)
    engine = llm.engine
    for i in range(8):
        prompt = [r.randrange(3, 384) for _ in range(r.randrange(2, 6))] * r.randrange(1, 4)
        params = SamplingParams(temperature=temperature, max_tokens=r.randrange(1, 20), ignore_eos=True, seed=i)
        engine.add_request(EngineRequest(str(i), prompt, params, engine.validate(prompt, params)))
    for step in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
        for victim in aborts:
            if step == victim:
                engine.abort(str(victim))
        engine.kv.check_integrity()
    assert not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


# -- draft models ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft(make_checkpoint: Callable[..., Path]) -> Path:
    """A smaller model with the same tokenizer (its own random weights: it rarely guesses right)."""
    return make_checkpoint("llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64, seed=1)


@pytest.mark.parametrize("which", ["itself", "smaller"])
def test_a_draft_model_changes_no_greedy_token(folder: Path, draft: Path, which: str) -> None:
    """The target as its own draft guesses every token (all drafts kept); a random smaller one guesses none.
    Either way the output is the same, and both KV pools come back whole."""
    model = str(folder) if which == "itself" else str(draft)
    prompts = [p[:9] for p in PROMPTS[:6]]
    _, want = _run(folder, prompts, GREEDY)
    llm, got = _run(folder, prompts, GREEDY, **{**SPEC, "speculative_model": model, "num_speculative_tokens": 3})
    assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
    stats, pool = llm.engine.stats, llm.engine.proposer.kv  # type: ignore[union-attr]
    assert stats.spec_draft_tokens > 0
    if which == "itself":
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert pool.num_free_blocks == pool.num_blocks  # the draft's pool too


def test_a_bfloat16_model_as_its_own_draft_keeps_every_draft(folder: Path) -> None:
    """On the CPU a draft's rounds run in one call into the decode stack, whose LM head's chunks each find their
    columns' argmax over a bf16 model's logits (widened to float32, as the target's sampler takes them) before the
    chunks' winners are compared (the vocabulary spans several chunks). The target as its own draft then guesses
    every token, and the output is the same."""
    prompts = [{"prompt_token_ids": p[:9]} for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(str(folder), dtype="bfloat16", device="cpu").generate(prompts, params)
    llm = LLM(str(folder), dtype="bfloat16", device="cpu",
              **{**SPEC, "speculative_model": str(folder), "num_speculative_tokens": 3})  # fmt: skip
    stack = llm.engine.proposer.runner.decode_stack  # type: ignore[union-attr]
    if stack is None or not stack.greedy_ready:
        pytest.skip("the draft runs without the decode stack here (no CPU kernels): its native rounds do not apply")
    calls = 0
    native_greedy = stack.greedy_drafts

    def counted(*args: Any) -> list[list[int]]:
        nonlocal calls
        calls += 1
        return native_greedy(*args)

    stack.greedy_drafts = counted  # type: ignore[method-assign]
    got = llm.generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    stats = llm.engine.stats
    assert calls > 0 and stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_a_draft_model_keeps_the_target_distribution(folder: Path) -> None:
    prompt = list(range(3, 384))
    random.Random(1).shuffle(prompt)
    spec = _chi_square(folder, prompt, **{**SPEC, "speculative_model": str(folder), "num_speculative_tokens": 2})
    assert spec < CHI2_DF8_P001, spec


def test_a_draft_with_another_tokenizer_is_refused(folder: Path, tmp_path: Path) -> None:
    from tests.conftest import build_tokenizer
    from tokenmill.make_model import hf_config, write_checkpoint

    other = write_checkpoint(hf_config("llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=320),
                             build_tokenizer(tmp_path / "tok", vocab_size=300), tmp_path / "other")  # fmt: skip
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(str(folder), dtype="float32", device=target.DEVICE, speculative_model=str(other))


def test_tokens_past_the_drafts_vocabulary_get_no_drafts(make_checkpoint: Callable[..., Path], draft: Path) -> None:
    """A target whose vocabulary is padded past the draft's (the same tokenizer, a wider embedding) can take token
    ids the draft has no row for: a sequence holding one gets no drafts (its native catch-up would read past the
    draft's embedding), the others still do, and the output is the target's alone."""
    wide = make_checkpoint("llama", vocab_size=400, initializer_range=0.1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    past, plain = [5, 17, 390, 9, 395], PROMPTS[0]  # 390, 395: the target's rows, past the draft's 384
    want = LLM(str(wide), dtype="float32", device=target.DEVICE).generate(
        [{"prompt_token_ids": p} for p in (past, plain)], params
    )
    llm = LLM(str(wide), dtype="float32", device=target.DEVICE, speculative_model=str(draft), num_speculative_tokens=3)
    got = [llm.generate([{"prompt_token_ids": past}], params)[0]]
    assert llm.engine.stats.spec_draft_tokens == 0
    got += llm.generate([{"prompt_token_ids": plain}], params)
    assert llm.engine.stats.spec_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_the_demo_model_ships_its_draft() -> None:
    """`--speculative-model demo-draft` needs no download, keeps drafts, and changes no greedy token."""
    params = SamplingParams(temperature=0, max_tokens=40)
    want = LLM(device=target.DEVICE).generate(["ROMEO:", "JULIET:\nO Romeo"], params)
    llm = LLM(device=target.DEVICE, speculative_model="demo-draft", num_speculative_tokens=3)
    got = llm.generate(["ROMEO:", "JULIET:\nO Romeo"], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.stats.spec_accepted_tokens > 0


def test_a_proposer_that_keeps_missing_is_paused(folder: Path, draft: Path) -> None:
    """The random smaller draft never guesses right: after two fruitless rounds a sequence pauses drafting for
    2, 4, ... steps, so over 60 tokens it drafts in a handful of rounds, not in every step."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    _, want = _run(folder, PROMPTS[:1], params)
    llm, got = _run(
        folder, PROMPTS[:1], params, **{**SPEC, "speculative_model": str(draft), "num_speculative_tokens": 3}
    )
    assert got[0][0].token_ids == want[0][0].token_ids
    stats = llm.engine.stats
    assert stats.spec_accepted_tokens == 0 and 0 < stats.spec_draft_tokens <= 3 * 8  # 60 steps would draft 177


def test_a_quantized_draft_changes_no_greedy_token(folder: Path) -> None:
    """--speculative-model-quantization int8 quantizes the draft alone: it proposes a little differently, the
    target verifies as before, so the output stays token for token the same."""
    prompts = [p[:9] for p in PROMPTS[:4]]
    _, want = _run(folder, prompts, GREEDY)
    spec = {**SPEC, "speculative_model": str(folder), "num_speculative_tokens": 3}
    llm, got = _run(folder, prompts, GREEDY, **spec, speculative_model_quantization="int8")
    assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
    assert llm.engine.stats.spec_accepted_tokens > 0
    draft = llm.engine.proposer.runner.model  # type: ignore[union-attr]
    # int8 (Q8_0) linears: the CPU kernels' KernelLinear, or on a GPU the Triton kernels' CudaBlockLinear
    assert any(getattr(m, "format", None) == "q8_0" for m in draft.modules())
    with pytest.raises(ValueError, match="speculative_model_quantization"):
        LLM(str(folder), speculative_model=str(folder), speculative_model_quantization="int3")

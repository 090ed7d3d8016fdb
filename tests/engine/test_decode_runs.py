"""Decode runs (`num_scheduler_steps`): several greedy decode steps in one call of the decode stack. Greedy output
is token for token what one step a call gives, stops inside a run end the sequence where they should, runs are
only taken where the scheduler's rules allow them, and the KV pool comes back whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests import target
from tokenmill import LLM, SamplingParams
from tokenmill.scheduler import MAX_SEQS_FOR_RUNS

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 100 + i] for i in range(6)]

pytestmark = pytest.mark.skipif(target.DEVICE != "cpu", reason="decode runs belong to the CPU decode stack")


@pytest.fixture(scope="module", params=[("qwen2", "float32", "none"), ("llama", "bfloat16", "int4")])
def llms(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]) -> dict[int, LLM]:
    arch, dtype, quantization = request.param
    folder = make_checkpoint(arch, initializer_range=0.1)
    built = {k: LLM(str(folder), dtype=dtype, quantization=quantization, num_scheduler_steps=k) for k in (1, 3, 4)}
    if not built[4].engine.runner.runs_decode_steps:
        pytest.skip("this build has no decode stack (no compiler, or --no-cpu-kernels): every step is one step")
    return built


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], int]:
    """(each request's tokens, the engine steps it took); checks that every KV block came back."""
    steps = llm.engine.stats.num_steps
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks  # every block back, the runs' lookahead slots included
    return [list(o.outputs[0].token_ids) for o in outs], llm.engine.stats.num_steps - steps


def test_runs_give_the_tokens_single_steps_give(llms: dict[int, LLM]) -> None:
    """One to four sequences of different lengths (runs shrink to the shortest budget), then six (more than the
    runs' limit): the same greedy tokens with runs of 3 and 4 as with one step a call, in fewer steps."""
    for n in (1, 2, MAX_SEQS_FOR_RUNS, MAX_SEQS_FOR_RUNS + 2):
        lengths = [9 + 5 * i if n <= MAX_SEQS_FOR_RUNS else 9 for i in range(n)]  # too many: all to the end
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
        single, single_steps = _generate(llms[1], PROMPTS[:n], params)
        for k in (3, 4):
            tokens, steps = _generate(llms[k], PROMPTS[:n], params)
            assert tokens == single, (n, k)
            if n <= MAX_SEQS_FOR_RUNS:
                assert steps < single_steps
            else:
                assert steps == single_steps  # too many sequences for runs: one step a call


def test_a_stop_inside_a_run_ends_the_sequence_there(llms: dict[int, LLM]) -> None:
    """A stop token met anywhere in a run (its first, middle or last token, or the length limit's) ends the output
    with it (stop_reason set, the tokens counted once); the tokens the run computed after it are dropped, as are
    those after a stop string."""
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full, _ = _generate(llms[1], PROMPTS[:1], [free])
    positions = [i for i in range(1, 12) if full[0].index(full[0][i]) == i]  # tokens that first appear there
    assert len(positions) >= 4, full[0]
    for i in positions:
        stop = full[0][i]
        at_stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
        for k in (1, 4):
            out = llms[k].generate([{"prompt_token_ids": PROMPTS[0]}], at_stop)[0]
            assert list(out.outputs[0].token_ids) == full[0][: i + 1], (i, k)
            assert out.outputs[0].stop_reason == stop and out.outputs[0].finish_reason == "stop"
            assert out.metrics is not None and out.metrics.num_generated_tokens == i + 1
    text = llms[1].generate([{"prompt_token_ids": PROMPTS[0]}], free)[0].outputs[0].text
    middle = len(text) // 2
    needle = next(text[i : i + 2] for i in range(middle, len(text) - 1) if text[i : i + 2].strip())
    by_string = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[needle])
    want = llms[1].generate([{"prompt_token_ids": PROMPTS[0]}], by_string)[0].outputs[0]
    got = llms[4].generate([{"prompt_token_ids": PROMPTS[0]}], by_string)[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 20
    assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids), "stop")


def test_stop_strings_anywhere_in_a_run_end_it_as_single_steps_do(llms: dict[int, LLM]) -> None:
    """A stop string completed at each token in turn, a run's last included, and the last token of all, where the
    length limit ends the sequence too: runs give the single steps' text, tokens, finish and stop reason, and
    count only the tokens they keep. Where the string and the length limit meet on one token, the string is the
    reason (as vLLM has it). Runs of 4 after the prefill's token: tokens 2-5, 6-9, 10-12."""
    texts = [""] + [
        llms[1]
        .generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0]
        .outputs[0]
        .text
        for m in range(1, 13)
    ]
    tried = []
    for m in range(2, 13):
        # the shortest end of the text at m tokens that the text at m - 1 lacks: first completed by token m
        ends = [texts[m][-n:] for n in range(1, 5) if n <= len(texts[m])]
        needle = next((e for e in ends if e.strip() and "\ufffd" not in e and e not in texts[m - 1]), None)
        if needle is None:
            continue
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[needle])
        got = {}
        for k in (1, 4):
            out = llms[k].generate([{"prompt_token_ids": PROMPTS[0]}], params)[0]
            c, metrics = out.outputs[0], out.metrics
            assert metrics is not None and metrics.num_generated_tokens == len(c.token_ids) == len(metrics.token_times)
            got[k] = (c.text, list(c.token_ids), c.finish_reason, c.stop_reason)
            assert llms[k].engine.kv.num_free_blocks == llms[k].engine.kv.num_blocks
        assert got[4] == got[1], (m, needle)
        assert len(got[1][1]) == m and got[1][2:] == ("stop", needle)
        tried.append(m)
    assert len(tried) >= 3 and {5, 9, 12} & set(tried), tried  # a run's last token among them


def test_n_samples_run_together_and_give_back_every_block(llms: dict[int, LLM]) -> None:
    """n = 3 greedy samples of two prompts (six sequences: single steps until one prompt's samples finish, then
    runs): the same tokens as single steps, and every block back."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=3) for m in (6, 17)]
    want = llms[1].generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    steps = llms[4].engine.stats.num_steps
    got = llms[4].generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert llms[4].engine.stats.num_steps - steps < 17  # the longer prompt's samples ran
    kv = llms[4].engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_drawn_runs_give_the_tokens_single_steps_give(make_checkpoint: Callable[..., Path]) -> None:
    """Rows that draw (temperature, top-k, top-p, min-p; seeded and not) beside a greedy one: every step of a run
    takes the uniform numbers a single step would, and draws as the sampler's kernel does: the same tokens, in
    fewer steps. Fresh engines, so that the unseeded row's generator starts alike in both."""
    folder = make_checkpoint("llama", initializer_range=0.1)
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=1, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    ]
    got = {}
    for k in (1, 4):
        llm = LLM(str(folder), dtype="bfloat16", num_scheduler_steps=k)
        if not llm.engine.runner.runs_decode_steps:
            pytest.skip("this build has no decode stack (no compiler): every step is one step")
        got[k] = _generate(llm, PROMPTS[:4], params)
    assert got[4][0] == got[1][0] and got[4][1] < got[1][1]
    assert len({tuple(t) for t in got[1][0]}) == 4  # the rows differ: the draws were not all the argmax


def test_runs_only_for_rows_that_read_nothing_but_a_draw_or_the_argmax(llms: dict[int, LLM]) -> None:
    """Logprobs, a penalty or a logit bias in the batch, or min_tokens still to reach: one step a call for every
    sequence, and the same tokens as without runs."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    others = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logit_bias={7: 2.0}),
    ]
    for other in others:
        want, single_steps = _generate(llms[1], PROMPTS[:2], [greedy, other])
        got, steps = _generate(llms[4], PROMPTS[:2], [greedy, other])
        assert got == want and steps == single_steps, other
    # min_tokens: one step a call until it is reached, then runs
    late = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, ignore_eos=True)
    want, single_steps = _generate(llms[1], PROMPTS[:1], [late])
    got, steps = _generate(llms[4], PROMPTS[:1], [late])
    assert got == want and 6 < steps < single_steps


def test_no_run_while_a_request_waits(make_checkpoint: Callable[..., Path]) -> None:
    """One sequence at a time (`max_num_seqs` 1) and two requests of 10 tokens: the first decodes one step a call
    while the second waits (a prefill and 9 steps); the second, alone, runs (a prefill and runs of 4, 4 and 1)."""
    folder = make_checkpoint("qwen2", initializer_range=0.1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = {}
    for k in (1, 4):
        llm = LLM(str(folder), dtype="float32", max_num_seqs=1, num_scheduler_steps=k)
        if not llm.engine.runner.runs_decode_steps:
            pytest.skip("this build has no decode stack (no compiler): every step is one step")
        got[k] = _generate(llm, PROMPTS[:2], [params, params])
        computed = [step.num_tokens for step in llm.engine.stats.recent_steps]
        # each step computes a prompt, one token or a run's: nothing is computed twice
        assert computed == [5] + [1] * 9 + [5] + ([1] * 9 if k == 1 else [4, 4, 1])
    assert got[4][0] == got[1][0]
    assert (got[1][1], got[4][1]) == (20, 10 + 4)


def test_runs_stop_at_the_context_end(make_checkpoint: Callable[..., Path]) -> None:
    """A sequence without max_tokens ends at `max_model_len` ("length"), 11 tokens after a 5-token prompt: runs of
    4, 4 and 2, with the tokens one step a call gives."""
    folder = make_checkpoint("qwen2", initializer_range=0.1)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    got = {}
    for k in (1, 4):
        llm = LLM(str(folder), dtype="float32", max_model_len=16, num_scheduler_steps=k)
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0].outputs[0]
        got[k] = (list(out.token_ids), out.finish_reason)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert got[4] == got[1] and len(got[1][0]) == 16 - len(PROMPTS[0]) and got[1][1] == "length"


def test_a_runs_last_blocks_serve_the_prefix_cache(make_checkpoint: Callable[..., Path]) -> None:
    """A 5-token prompt and 28 tokens out: the last run (of 3) fills the second block of 16, which it had as
    lookahead. Released, its full blocks are registered as single steps register them, so a follow-up prompt of
    the whole conversation finds both blocks cached."""
    folder = make_checkpoint("qwen2", initializer_range=0.1)
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    cached = {}
    for k in (1, 4):
        llm = LLM(str(folder), dtype="float32", block_size=16, num_scheduler_steps=k)
        first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0].outputs[0]
        follow = PROMPTS[0] + list(first.token_ids)
        again = llm.generate([{"prompt_token_ids": follow}], SamplingParams(temperature=0, max_tokens=2))[0]
        assert again.metrics is not None
        cached[k] = again.metrics.num_cached_tokens
        llm.engine.kv.check_integrity()
    assert cached == {1: 32, 4: 32}


def test_a_prompts_last_token_alone_gives_its_first_token_at_once(make_checkpoint: Callable[..., Path]) -> None:
    """A 17-token prompt in chunks of 16: its last chunk is one token, which samples the first output token in that
    step, as without runs (a run there would hold the first token back for 3 more steps); then runs of 4."""
    folder = make_checkpoint("qwen2", initializer_range=0.1)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, num_scheduler_steps=4)
    prompt = [(7 * i) % 300 + 3 for i in range(17)]
    tokens, _ = _generate(llm, [prompt], [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)])
    assert len(tokens[0]) == 9
    assert [step.num_tokens for step in llm.engine.stats.recent_steps] == [16, 1, 4, 4]

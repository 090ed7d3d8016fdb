"""Behaviour of the batched sampler: every knob must change what is drawn, exactly as documented."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tokenmill.sampling.filters import apply_filters
from tokenmill.sampling.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    topk_logprobs,
)
from tokenmill.sampling_params import SamplingParams as SP
from tokenmill.step_plan import row_reads
from tokenmill.types import LogitsRead


def make_batch(
    params: Sequence[SP],
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    suppressed: Sequence[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params, prompts or [[]] * n, outputs or [[]] * n, generators or [None] * n, suppressed or [[]] * n
    )


def draw(row: torch.Tensor, params: SP, n: int = 2000, seed: int = 0, suppressed: list[int] | None = None):
    """Sample n times from one row of logits (n identical rows in one batch); return the drawn token ids."""
    logits = row[None, :].expand(n, -1).clone()
    out = Sampler(seed)(logits, make_batch([params] * n, suppressed=[suppressed or []] * n))
    return torch.tensor(out.token_ids)


def freqs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_build_maps_params_to_columns() -> None:
    b = make_batch([SP(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1, logprobs=3), SP(top_k=7)])
    assert b.temperature.tolist() == [0.5, 1.0]
    assert b.top_k.tolist() == [0, 7] and b.top_k.dtype == torch.int64  # -1 means off, stored as 0
    assert b.top_p.tolist() == pytest.approx([0.9, 1.0]) and b.min_p.tolist() == pytest.approx([0.1, 0.0])
    assert b.num_logprobs == [3, None]


def test_greedy_picks_argmax() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 2
    out = Sampler(0)(logits, make_batch([SP(temperature=0)] * 64))
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("params", "suppressed", "grammar"),
    [(SP(temperature=0.7), [], False), (SP(temperature=0, logprobs=0), [], False),
     (SP(temperature=0, logit_bias={3: -100.0}), [], False), (SP(temperature=0, repetition_penalty=1.5), [], False),
     (SP(temperature=0, presence_penalty=2.0), [], False), (SP(temperature=0, frequency_penalty=2.0), [], False),
     (SP(temperature=0), [3], False), (SP(temperature=0), [], True)],
)  # fmt: skip
def test_what_reads_the_logits_beyond_their_argmax(params: SP, suppressed: list[int], grammar: bool) -> None:
    """The decode stack skips its float32 logits where the step's plan reads only the argmax (step_plan.row_reads):
    each of a draw, logprobs, a bias, a penalty, suppressed tokens and a grammar reads them, alone in a batch of
    greedy rows, and without any of them the sampler returns the argmax it is handed, with logits=None."""
    greedy = SP(temperature=0)
    assert row_reads(greedy, [], False) == LogitsRead.ARGMAX
    assert row_reads(params, suppressed, grammar) > LogitsRead.ARGMAX
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1)
    out = Sampler(0)(None, make_batch([greedy, greedy]), top)
    assert out.token_ids == top.tolist() and out.logprobs == [None, None]
    batch = make_batch([greedy, params], suppressed=[[], suppressed])
    if grammar:
        batch.bitmask = torch.full((2, 2), -1, dtype=torch.int32)  # every token allowed, but a mask to apply
    with pytest.raises(AssertionError):  # a row that reads its logits must be handed them
        Sampler(0)(None, batch, top)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    got = freqs(draw(row, SP(temperature=temperature), n=4000), 8)
    expected = (row / temperature).softmax(-1)
    assert (got - expected).abs().max() < 0.03
    if temperature != 1.0:  # the check discriminates: the T=1 distribution is far from this one
        assert (row.softmax(-1) - expected).abs().max() > 0.1


def test_low_temperature_concentrates_high_flattens() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5])
    top = [freqs(draw(row, SP(temperature=t)), 8)[0].item() for t in (0.1, 1.0, 5.0)]
    assert top[0] > 0.95 and top[0] > top[1] + 0.3 and top[1] > top[2] + 0.1
    spread = freqs(draw(row, SP(temperature=5.0)), 8)
    assert (spread > 0.05).all()  # every token drawn often when hot


def test_top_k_never_samples_outside_top_k() -> None:
    row = torch.randn(20, generator=torch.Generator().manual_seed(2)) * 0.3  # flat: all tokens likely
    top5 = set(row.topk(5).indices.tolist())
    assert set(draw(row, SP(top_k=5)).tolist()) == top5
    assert set(draw(row, SP(top_k=1)).tolist()) == {int(row.argmax())}
    assert len(set(draw(row, SP(top_k=-1)).tolist())) == 20


def test_top_k_is_per_row_in_a_mixed_batch() -> None:
    row = torch.zeros(10)
    row[:3] = 0.1  # tokens 0..2 are the top 3
    logits = row[None].expand(1000, -1).clone()
    params = [SP(top_k=3), SP(top_k=0)] * 500
    toks = torch.tensor(Sampler(0)(logits, make_batch(params)).token_ids)
    assert set(toks[0::2].tolist()) == {0, 1, 2}
    assert set(toks[1::2].tolist()) == set(range(10))


def test_top_p_keeps_token_whose_preceding_mass_is_below_p() -> None:
    probs = [0.35, 0.25, 0.2, 0.1, 0.05, 0.05]  # mass before each: 0, .35, .6, .8, .9, .95
    row = logits_of(probs)
    filtered = apply_filters(row[None], make_batch([SP(top_p=0.75)]))[0]
    assert torch.isfinite(filtered).tolist() == [True, True, True, False, False, False]
    got = freqs(draw(row, SP(top_p=0.75), n=4000), 6)
    assert got[3:].sum() == 0
    expected = torch.tensor(probs[:3]) / 0.8  # renormalised nucleus
    assert (got[:3] - expected).abs().max() < 0.03
    assert set(draw(row, SP(top_p=0.3)).tolist()) == {0}  # the top token is always kept


def test_top_p_is_per_row_in_a_mixed_batch() -> None:
    row = logits_of([0.35, 0.25, 0.2, 0.1, 0.05, 0.05])
    logits = row[None].expand(1000, -1).clone()
    toks = torch.tensor(Sampler(0)(logits, make_batch([SP(top_p=0.5), SP(top_p=0.99)] * 500)).token_ids)
    assert set(toks[0::2].tolist()) == {0, 1}
    assert set(toks[1::2].tolist()) == set(range(6))


def test_top_p_one_row_unfiltered_even_beside_top_p_row() -> None:
    row = torch.tensor([0.0, 0.0, -19.0, -20.0])
    alone = apply_filters(row[None], make_batch([SP(top_p=1.0)]))[0]
    mixed = apply_filters(row[None].expand(2, -1).clone(), make_batch([SP(top_p=1.0), SP(top_p=0.9)]))[0]
    assert torch.isfinite(alone).all()
    assert torch.equal(mixed, alone)


def _transformers_filters(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = logits.clone()
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)  # type: ignore[arg-type]
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)  # type: ignore[arg-type]
    return scores


@pytest.mark.parametrize(
    ("scale", "top_k", "top_p"),
    [(4.0, 0, 0.9), (4.0, 50, 0.9), (4.0, 300, 0.95), (2.0, 0, 0.9), (0.05, 0, 0.95), (0.05, 5000, 0.5),
     (4.0, 40, 1.0), (0.0, 5, 1.0)],
)  # fmt: skip
def test_top_k_and_top_p_keep_what_transformers_keeps(scale: float, top_k: int, top_p: float) -> None:
    """Over a vocabulary larger than the candidates top-k and top-p look among (filters.CANDIDATES, 256 then
    4096): a nucleus inside the first, inside the second, past both (the whole row sorted), a k past the first and
    past the second, a k alone, and all-tied rows (transformers' top-k keeps every token tied with the k-th;
    which tied tokens a top-p keeps follows the sort, so ties are not compared there). A row without filters
    beside them keeps all."""
    from tokenmill.sampling import filters

    vocab = 2 * filters.CANDIDATES[-1]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * scale
    params = [SP(top_k=top_k, top_p=top_p), SP(), SP(top_k=top_k, top_p=top_p)]
    ours = apply_filters(logits, make_batch(params))
    theirs = _transformers_filters(logits, top_k, top_p)
    for row in (0, 2):
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(theirs[row]))
        assert torch.equal(ours[row][torch.isfinite(ours[row])], logits[row][torch.isfinite(ours[row])])
    assert torch.equal(ours[1], logits[1])
    kept = int(torch.isfinite(ours[0]).sum())
    if scale == 0.0:
        assert kept == vocab  # every token ties
    elif top_k == 0 and scale < 1:
        assert kept > filters.CANDIDATES[-1]  # the flat row's nucleus reaches past the candidates
    elif top_k == 0 and scale == 2:
        assert filters.CANDIDATES[0] < kept < filters.CANDIDATES[-1]


def test_inverse_transform_never_picks_a_token_without_mass() -> None:
    """u = 0 picks the first token with mass; a u between two tokens' running sums picks the later one; u = 1 (as
    a u whose product with the total rounds up to it) picks the last token with mass, never a zero past it. Weights
    need not sum to 1."""
    from tokenmill.sampling.sampler import inverse_transform

    weights = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 1.0], dtype=torch.float64)
    assert inverse_transform(weights, u).tolist() == [1, 1, 3, 3]


def test_inverse_transform_reaches_tokens_below_float32_resolution() -> None:
    """1000 tokens of 1e-8 after one of 0.75: a float32 running sum would not rise over them (its step there is
    6e-8), so no u could draw them; the sums are float64."""
    from tokenmill.sampling.sampler import inverse_transform

    weights = torch.cat([torch.tensor([0.75]), torch.full((1000,), 1e-8), torch.tensor([0.25 - 1e-5])])[None]
    total = float(weights.double().sum())
    u = torch.tensor([(0.75 + 500.5e-8) / total], dtype=torch.float64)
    assert inverse_transform(weights, u).item() in (500, 501, 502)


def test_each_rows_kept_tokens_do_not_depend_on_the_batch() -> None:
    """Rows with different filters in one batch keep what each keeps alone, whichever candidates the batch needs
    (a flat top-p row makes every row's be the whole sorted vocabulary): a top-k, a top-p whose last kept token ties
    with others, both, a top-k past the vocabulary (off), a flat nucleus, and a greedy row (its filters unused). A
    seeded row draws the same alone and beside them."""
    vocab = 8192
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, vocab, generator=gen) * 4
    logits[1] = -10.0
    logits[1, [8000, 17, 4090, 6000]] = torch.tensor([5.0, 3.0, 3.0, 3.0])  # the nucleus at 0.75 ends in a tie
    logits[4] *= 0.01  # flat
    params = [SP(top_k=50), SP(top_p=0.75), SP(top_k=300, top_p=0.8), SP(top_k=2**31 - 1), SP(top_p=0.95),
              SP(temperature=0, top_p=0.5)]  # fmt: skip
    together = apply_filters(logits, make_batch(params))
    for i, p in enumerate(params):
        alone = apply_filters(logits[i : i + 1], make_batch([p]))[0]
        assert torch.equal(torch.isfinite(together[i]), torch.isfinite(alone)), p
    assert set(torch.isfinite(together[1]).nonzero().flatten().tolist()) == {8000, 17, 4090, 6000}
    assert torch.isfinite(together[3]).all() and torch.isfinite(together[5]).all()
    for seed in range(20):
        draws = []
        for rows in ([1], [0, 1, 2, 3, 4, 5]):
            gens: list[torch.Generator | None] = [None] * len(rows)
            gens[rows.index(1)] = torch.Generator().manual_seed(seed)
            out = Sampler(seed + 100)(logits[rows], make_batch([params[r] for r in rows], generators=gens))
            draws.append(out.token_ids[rows.index(1)])
        assert draws[0] == draws[1]


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = [0.5, 0.2, 0.12, 0.08, 0.06, 0.04]  # threshold 0.2 * 0.5 = 0.1
    row = logits_of(probs)
    filtered = apply_filters(row[None], make_batch([SP(min_p=0.2)]))[0]
    assert torch.isfinite(filtered).tolist() == [True, True, True, False, False, False]
    assert set(draw(row, SP(min_p=0.2)).tolist()) == {0, 1, 2}
    assert set(draw(row, SP(min_p=0.0)).tolist()) == set(range(6))


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(3)) * 2
    logits[0, 3], logits[0, 7] = 1.5, -1.5  # a positive and a negative seen logit
    penalties = [1.3, 0.8, 1.0]
    prompts, outputs = [[0, 3, 3], [], [4]], [[5, 7], [1, 2], [4]]
    params = [SP(repetition_penalty=p) for p in penalties]
    got = apply_penalties(logits.clone(), make_batch(params, prompts, outputs))
    for i, penalty in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], expected)
    assert got[0, 3] == pytest.approx(1.5 / 1.3) and got[0, 7] == pytest.approx(-1.5 * 1.3)  # prompt/output
    unseen = [t for t in range(12) if t not in (0, 3, 5, 7)]
    assert torch.equal(got[0, unseen], logits[0, unseen])


def test_presence_and_frequency_penalise_output_tokens_only() -> None:
    logits = torch.linspace(-2, 2, 8).repeat(3, 1)
    params = [SP(presence_penalty=0.5, frequency_penalty=0.25), SP(presence_penalty=-1.0), SP()]
    prompts, outputs = [[1, 3], [1], [0]], [[2, 2, 5, 2], [4], [0, 0]]
    got = apply_penalties(logits.clone(), make_batch(params, prompts, outputs))
    expected = logits.clone()
    expected[0, 2] -= 0.5 + 3 * 0.25
    expected[0, 5] -= 0.5 + 1 * 0.25
    expected[1, 4] += 1.0
    torch.testing.assert_close(got, expected)


def test_presence_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    outputs = [[1]]
    assert Sampler(0)(logits, make_batch([SP(temperature=0)], outputs=outputs)).token_ids == [1]
    penalised = make_batch([SP(temperature=0, presence_penalty=1.0)], outputs=outputs)
    assert Sampler(0)(logits, penalised).token_ids == [2]
    prompt_only = make_batch([SP(temperature=0, presence_penalty=1.0)], prompts=[[1]])
    assert Sampler(0)(logits, prompt_only).token_ids == [1]


def test_suppressed_tokens_never_sampled() -> None:
    row = torch.zeros(10)
    row[4] = 20.0  # overwhelming argmax
    assert set(draw(row, SP(temperature=0), n=8, suppressed=[4]).tolist()) == {int(row[:4].argmax())}
    toks = draw(row, SP(temperature=1.0), suppressed=[4, 7])
    assert 4 not in toks.tolist() and 7 not in toks.tolist() and len(set(toks.tolist())) == 8
    assert set(draw(row, SP(top_k=1), n=200, suppressed=[4]).tolist()) == set(range(10)) - {4}  # nine tied at 0
    assert set(draw(row, SP(), n=200).tolist()) == {4}  # without suppression 4 always wins


def test_sampler_does_not_modify_input_logits() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    Sampler(0)(logits, make_batch([SP(repetition_penalty=2.0), SP()], [[1], [2]], [[3], [4]], None, [[5], [6]]))
    assert torch.equal(logits, before)


def _seeded_run(seed: int, position: int, others: int, sampler_seed: int, steps: int = 10) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    vocab, drawn = 50, []
    other_logits = torch.randn(others, vocab, generator=torch.Generator().manual_seed(sampler_seed))
    sampler = Sampler(sampler_seed)
    for _ in range(steps):
        logits = torch.cat([other_logits[:position], torch.zeros(1, vocab), other_logits[position:]])
        gens: list[torch.Generator | None] = [None] * (others + 1)
        gens[position] = gen
        out = sampler(logits, make_batch([SP()] * (others + 1), generators=gens))
        drawn.append(out.token_ids[position])
    return drawn


def test_seeded_row_reproducible_regardless_of_batch() -> None:
    a = _seeded_run(1234, position=0, others=2, sampler_seed=0)
    b = _seeded_run(1234, position=3, others=4, sampler_seed=99)
    assert a == b
    assert _seeded_run(4321, position=0, others=2, sampler_seed=0) != a
    assert len(set(a)) > 1  # the draws really are random over steps


def test_logprobs_hold_sampled_plus_top_k_from_raw_logits() -> None:
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(5)) * 2
    order = logits.argsort(dim=-1, descending=True)
    params = [
        SP(temperature=0, logprobs=3),
        SP(temperature=0, logprobs=3),
        SP(temperature=0),
        SP(temperature=0.3, repetition_penalty=2.0, presence_penalty=1.5, logprobs=2),
        SP(temperature=0, logprobs=0),
    ]
    suppressed = [order[0, :4].tolist(), [], [], [], []]  # row 0 must pick its 5th best token
    outputs = [[], [], [], order[3, :3].tolist(), []]
    out = Sampler(0)(logits.clone(), make_batch(params, outputs=outputs, suppressed=suppressed))
    raw = logits.log_softmax(-1)
    assert out.token_ids[0] == order[0, 4].item()
    assert out.logprobs[2] is None
    for i, k in [(0, 3), (1, 3), (3, 2), (4, 0)]:
        d = out.logprobs[i]
        assert d is not None
        tok = out.token_ids[i]
        top = order[i, :k].tolist()
        assert set(d) == set(top) | {tok}
        assert len(d) == (k if tok in top else k + 1)
        for t, v in d.items():
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
    assert len(out.logprobs[0]) == 4 and len(out.logprobs[1]) == 3 and len(out.logprobs[4]) == 1


def test_topk_logprobs_per_row_counts() -> None:
    lp = torch.tensor([[-0.1, -2.0, -3.0, -4.0], [-4.0, -3.0, -2.0, -0.1]])
    rows = topk_logprobs(lp, torch.tensor([3, 3]), [2, 1])
    assert rows[0] == pytest.approx({3: -4.0, 0: -0.1, 1: -2.0})
    assert rows[1] == pytest.approx({3: -0.1})


INVALID = [
    ({"temperature": -0.5}, "temperature", -0.5),
    ({"top_p": 0.0}, "top_p", 0.0),
    ({"top_p": 1.5}, "top_p", 1.5),
    ({"top_p": 1e-46}, "top_p", 1e-46),  # 0 in float32: the torch path's nucleus would be empty
    ({"temperature": 1e39}, "temperature", 1e39),  # inf in float32: every logit over it NaN or 0
    ({"repetition_penalty": 1e39}, "repetition_penalty", 1e39),
    ({"top_k": -2}, "top_k", -2),
    ({"min_p": 1.5}, "min_p", 1.5),
    ({"repetition_penalty": 0.0}, "repetition_penalty", 0.0),
    ({"presence_penalty": 3.0}, "presence_penalty", 3.0),
    ({"frequency_penalty": -2.5}, "frequency_penalty", -2.5),
    ({"n": 0}, "n", 0),
    ({"max_tokens": 0}, "max_tokens", 0),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", 5),
    ({"logprobs": 21}, "logprobs", 21),
    ({"stop": ""}, "stop", ""),
]


@pytest.mark.parametrize(("kwargs", "name", "bad"), INVALID, ids=[case[1] + str(case[2]) for case in INVALID])
def test_invalid_params_name_the_value(kwargs: dict, name: str, bad: object) -> None:
    with pytest.raises(ValueError) as info:
        SP(**kwargs)
    assert name in str(info.value) and repr(bad) in str(info.value)


def test_valid_edge_params_and_stop_string() -> None:
    SP(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=20)
    SP(min_tokens=3, max_tokens=3)
    assert SP(stop="x").stop == ["x"]
    assert SP(stop=None).stop == []  # type: ignore[arg-type]

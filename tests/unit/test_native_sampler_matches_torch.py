"""The sampler's kernels against its torch path, their reference, on every kernel variant this CPU runs: the draw
(kernels/csrc/ops/sample.h: temperature, top-k, top-p, min-p and the draw in one call) and the logprobs (logprobs.h)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import kernels
from tokenmill.sampling.filters import apply_filters
from tokenmill.sampling.sampler import Sampler, SamplingBatch, _scaled
from tokenmill.sampling_params import SamplingParams as SP

VOCAB = 2 * 4096 + 3  # past the torch path's candidates (256, 4096), and a tail after the last whole vector

# each row: what it tests
ROWS = [
    (SP(top_k=50), "a top-k in the heap"),
    (SP(top_k=2000), "a top-k past the heap (nth_element)"),
    (SP(top_k=VOCAB), "a top-k of the whole vocabulary: off"),
    (SP(top_p=0.75), "a nucleus that ends in a tie"),
    (SP(top_p=0.95), "a flat row's wide nucleus, many bins"),
    (SP(top_k=300, top_p=0.8, temperature=0.7), "both, below a temperature"),
    (SP(min_p=0.1, temperature=1.3), "a min-p"),
    (SP(top_k=3, top_p=0.5, min_p=0.01), "all three on a row of few distinct values (ties everywhere)"),
    (SP(top_p=0.9), "a nucleus among a grammar's -inf"),
    (SP(temperature=0, top_p=0.5), "a greedy row: its argmax, its filters unused"),
    (SP(top_k=5, top_p=0.5), "a top-k tied past the few tokens it draws among alone (draw_kept): the whole row"),
    (SP(top_k=2, min_p=0.5), "a top-k past a grammar's -inf: fewer finite tokens than k"),
    (SP(top_k=10, top_p=0.9), "4096 tokens tie with the k-th: the list at its most"),
    (SP(top_k=10, min_p=0.5), "4097 tokens tie with the k-th: one past the list, the whole row"),
]


def _logits(seed: int) -> torch.Tensor:  # [len(ROWS), VOCAB]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROWS), VOCAB, generator=gen) * 4
    logits[3] = -10.0
    logits[3, [8000, 17, 4090, 6000, VOCAB - 1]] = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0])  # 0.75 ends in the tie
    logits[4] *= 0.01
    logits[7] = torch.randint(0, 6, (VOCAB,), generator=gen).float()
    logits[8, ::3] = float("-inf")
    logits[10] = 0.0
    logits[11] = float("-inf")
    logits[11, 77] = 1.0
    for row, ties in ((12, 4096), (13, 4097)):
        logits[row] = torch.randn(VOCAB, generator=gen) - 10
        logits[row, torch.randperm(VOCAB, generator=gen)[:ties]] = 1.0
    return logits


def _batch(params: list[SP]) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, [[]] * n, [[]] * n, [None] * n, [[]] * n)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_keeps_what_the_torch_path_keeps(ops: kernels.Kernels, seed: int) -> None:
    """Each drawing row's values after its filters, over its temperature, equal the torch path's: the same tokens
    kept (ties with the k-th and with the nucleus's last token too), the same float32 values. A greedy row takes
    its argmax."""
    logits = _logits(seed)
    params = [p for p, _ in ROWS]
    batch = _batch(params)
    expected = apply_filters(_scaled(logits, batch, greedy=True), batch)
    filtered = torch.full_like(logits, 7.0)
    tokens = ops.draw(logits, params, [0.5] * len(params), filtered)
    for i, (p, what) in enumerate(ROWS):
        if p.temperature == 0:
            assert tokens[i] == int(logits[i].argmax()), what
            continue
        kept = torch.isfinite(filtered[i])
        assert torch.equal(kept, torch.isfinite(expected[i])), what
        assert torch.equal(filtered[i][kept], expected[i][kept]), what
        assert bool(kept[tokens[i]]), what
    assert int(torch.isfinite(filtered[3]).sum()) == 4  # 8000 and the three tied at 3.0
    assert int(torch.isfinite(filtered[10]).sum()) == VOCAB and tokens[11] == 77
    assert int(torch.isfinite(filtered[12]).sum()) == 4096 and int(torch.isfinite(filtered[13]).sum()) == 4097
    assert int(torch.isfinite(filtered[2]).sum()) == VOCAB and int(torch.isfinite(filtered[4]).sum()) > 4096


def test_kernel_draws_from_bfloat16_as_from_its_float32(ops: kernels.Kernels) -> None:
    """A bf16 model's logits, read as they are, keep and draw what their float32 widening does (widening is exact)."""
    logits = _logits(3).bfloat16()
    params = [p for p, _ in ROWS]
    u = torch.rand(len(params), dtype=torch.float64, generator=torch.Generator().manual_seed(0)).tolist()
    kept, wide = torch.empty(logits.shape), torch.empty(logits.shape)
    assert ops.draw(logits, params, u, kept) == ops.draw(logits.float(), params, u, wide)
    drawing = [i for i, p in enumerate(params) if p.temperature > 0]
    assert torch.equal(kept[drawing], wide[drawing])


def test_kernel_draws_what_the_torch_path_draws(ops: kernels.Kernels) -> None:
    """The same uniform numbers draw the same tokens: one Sampler with the kernels, one without, seeded alike,
    over steps of the batch above (seeded rows among them)."""
    params = [p for p, _ in ROWS]
    with_kernels, reference = Sampler(3, ops), Sampler(3)
    drawn: set[int] = set()
    for step in range(12):
        logits = _logits(100 + step)
        tokens = []
        for sampler in (with_kernels, reference):
            gens: list[torch.Generator | None] = [None] * len(params)
            gens[5] = torch.Generator().manual_seed(step)
            batch = SamplingBatch.build(params, [[]] * len(params), [[]] * len(params), gens, [[]] * len(params))
            tokens.append(sampler(logits, batch).token_ids)
        assert tokens[0] == tokens[1], step
        drawn.add(tokens[0][4])
    assert len(drawn) > 1  # the draws really are random


@pytest.mark.parametrize("top_p", [0.999, 0.999999])
def test_kernel_nucleus_near_one_as_float64_finds_it(ops: kernels.Kernels, top_p: float) -> None:
    """A nucleus of nearly the whole row ends where float64 sums put it: the mass before its last token under
    top_p, the mass before the next not. (The torch path's float32 running sums cannot resolve this: near 1 they
    step by 6e-8, and there it keeps a few tokens more or fewer.)"""
    for seed in range(3):
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
        filtered = torch.empty_like(logits)
        ops.draw(logits, [SP(top_p=top_p)], [0.5], filtered)
        x = logits[0].double()
        values = x.sort(descending=True).values
        probs = (values - values[0]).exp()
        probs /= probs.sum()
        before = probs.cumsum(0) - probs  # each token's mass before it, most likely first
        last = values[int((before < torch.tensor(top_p, dtype=torch.float32).double()).sum()) - 1]
        assert torch.equal(torch.isfinite(filtered[0]), x >= last), seed


def test_kernel_draws_the_ends_of_u_and_reaches_tiny_weights(ops: kernels.Kernels) -> None:
    """u = 0 draws the first kept token; u just under 1 the last; a NaN or a dropped token never. 1000 tokens of
    1e-8 after one of 0.75 are reachable (the sums are float64)."""
    row = torch.full((1, 40), float("-inf"))
    row[0, [3, 9, 30]] = torch.tensor([0.0, 1.0, 0.5])
    row[0, 20] = float("nan")
    assert ops.draw(row, [SP()], [0.0]) == [3]
    assert ops.draw(row, [SP()], [1 - 2**-53]) == [30]
    assert ops.draw(row, [SP(top_k=2)], [1 - 2**-53]) == [30]  # 3 dropped: 9 and 30 are the two largest
    assert ops.draw(row, [SP(top_k=1)], [0.0]) == [9]
    weights = [0.75] + [1e-8] * 1000 + [0.25 - 1e-5]
    tiny = torch.tensor([[math.log(w) for w in weights]])
    mass = [math.exp(float(x) - float(tiny.max())) for x in tiny[0]]  # as the kernel weighs them, to ~1 ulp
    u = (mass[0] + 500.5 * mass[1]) / sum(mass)
    assert ops.draw(tiny, [SP()], [u])[0] in (500, 501, 502)


@pytest.mark.parametrize("vocab", [5, 37, 600])  # under one vector, a tail after whole vectors, several blocks
def test_kernel_never_draws_nan_and_draws_inf_alone(ops: kernels.Kernels, vocab: int) -> None:
    """A NaN is never drawn; +inf logits (a tiny repetition penalty over a positive logit) are drawn alone, each
    alike, whatever the filters and wherever they lie (the last value, a tail past the vectors)."""
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(vocab))
    row[0, 1] = float("nan")
    for params in (SP(), SP(top_p=0.9), SP(top_k=2, min_p=0.5)):
        tokens = {ops.draw(row, [params], [u])[0] for u in (0.0, 0.3, 0.7, 1 - 2**-53)}
        assert 1 not in tokens and all(0 <= t < vocab for t in tokens), params
    row[0, [vocab - 1, 2]] = float("inf")
    for params in (SP(), SP(top_p=0.9), SP(top_k=3, min_p=0.1)):
        assert [ops.draw(row, [params], [u])[0] for u in (0.0, 0.49, 0.51)] == [2, 2, vocab - 1], params


def test_sampler_draws_alike_with_and_without_the_kernels(ops: kernels.Kernels) -> None:
    """The whole Sampler with the kernels and without, seeded alike, over steps of rows that a grammar's mask, a
    logit bias, suppressed tokens, penalties and logprobs each change first: the same tokens and logprobs."""
    vocab = 300
    params = [SP(top_k=20, logprobs=3), SP(top_p=0.8, logit_bias={7: 5.0}), SP(repetition_penalty=1.3, top_p=0.9),
              SP(temperature=0, presence_penalty=0.5, logprobs=0), SP(min_p=0.2, frequency_penalty=0.4),
              SP()]  # fmt: skip
    bitmask = torch.full((len(params), (vocab + 31) // 32), -1, dtype=torch.int32)
    bitmask[5, :4] = 0  # the last row may not take tokens 0-127
    with_kernels, reference = Sampler(11, ops), Sampler(11)
    for step in range(8):
        logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(step)) * 3
        outs = []
        for sampler in (with_kernels, reference):
            n = len(params)
            batch = SamplingBatch.build(
                params, [[1, 2, 3]] * n, [[4, 5, step]] * n, [None] * n, [[9]] * n, bitmask=bitmask
            )
            outs.append(sampler(logits, batch))
        assert outs[0].token_ids == outs[1].token_ids, step
        for mine, theirs in zip(outs[0].logprobs, outs[1].logprobs):
            assert (mine is None) == (theirs is None) and (mine is None or mine.keys() == theirs.keys()), step
            assert mine is None or theirs is None or all(abs(mine[t] - theirs[t]) < 1e-5 for t in mine), step
        assert outs[0].token_ids[5] >= 128 and 9 not in outs[0].token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_logprobs_equal_torchs(ops: kernels.Kernels, dtype: torch.dtype) -> None:
    """The chosen token's logprob and the row's most likely ones, as topk_logprobs over torch's log_softmax: each
    value to 1e-5, the same top values, most likely first and equal values by lower id (where torch's topk orders
    ties its own way: bf16 logits tie often), for the rows asked (a tail past the vectors, no top tokens, the most
    OpenAI allows, a row of ties)."""
    from tokenmill.sampling.sampler import topk_logprobs

    logits = (torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    logits[4] = 1.0
    rows, num_top = [0, 2, 3, 4], [0, 3, 20, 3]
    tokens = [5, int(logits[2].float().argmax()), VOCAB - 1, 9]  # row 2 chooses its most likely token
    mine = ops.logprobs(logits, rows, tokens, num_top)
    full = logits[rows].float().log_softmax(dim=-1)
    theirs = topk_logprobs(full, torch.tensor(tokens), num_top)
    for r, (token, k) in enumerate(zip(tokens, num_top)):
        assert next(iter(mine[r])) == token and all(abs(v - full[r, t].item()) < 1e-5 for t, v in mine[r].items())
        top = list(mine[r].items())[1:] if len(mine[r]) > k else list(mine[r].items())  # without the chosen token
        assert sorted(top, key=lambda tv: (-tv[1], tv[0])) == top, r
        assert [v for _, v in top] == pytest.approx(sorted(list(theirs[r].values())[-k:] if k else [], reverse=True))
    assert list(mine[3]) == [9, 0, 1, 2] and mine[3][0] == pytest.approx(-math.log(VOCAB), abs=1e-5)


@pytest.mark.parametrize("vocab", [3, 17])  # under one vector (a scalar row), one vector and a tail
def test_kernel_logprobs_of_short_rows_rank_minus_inf_last(ops: kernels.Kernels, vocab: int) -> None:
    """More top tokens asked than the row has: all of them; -inf logits rank last at -inf; the chosen token alone."""
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, 1:] = float("-inf")
    full = logits.log_softmax(dim=-1)
    everything, only_one, chosen = ops.logprobs(logits, [0, 1, 0], [2, 0, 1], [vocab + 5, 2, 0])
    assert sorted(everything) == list(range(vocab))
    assert all(abs(v - full[0, t].item()) < 1e-5 for t, v in everything.items())
    assert only_one == {0: pytest.approx(0.0, abs=1e-6), 1: float("-inf")}
    assert chosen == {1: pytest.approx(full[0, 1].item(), abs=1e-5)}


def test_sampler_widens_bf16_logits_for_all_but_a_draw(ops: kernels.Kernels) -> None:
    """Given a bf16 model's logits, the Sampler with the kernels draws from them as they are only where nothing else
    reads them; a mask, a bias, suppressed tokens, a penalty or logprobs get them as float32. Either way it samples
    what the float32 logits would give, with the kernels and without."""
    vocab = 300
    params = [SP(top_k=20, logprobs=2), SP(top_p=0.8, logit_bias={7: 5.0}), SP(repetition_penalty=1.3),
              SP(temperature=0), SP(min_p=0.2)]  # fmt: skip
    bitmask = torch.full((len(params), (vocab + 31) // 32), -1, dtype=torch.int32)
    bitmask[4, :4] = 0
    logits = (torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    n = len(params)
    for rows, mask in ((list(range(n)), bitmask), ([2, 3, 4], None), ([3, 4], None)):
        ps = [params[r] for r in rows]

        def batch(ps: list[SP] = ps, rows: list[int] = rows, mask: torch.Tensor | None = mask) -> SamplingBatch:
            m = None if mask is None else mask[rows]
            return SamplingBatch.build(
                ps, [[1, 2]] * len(ps), [[3]] * len(ps), [None] * len(ps), [[9]] * len(ps), bitmask=m
            )

        outs = [Sampler(5, ops)(logits[rows], batch()), Sampler(5, ops)(logits[rows].float(), batch()),
                Sampler(5)(logits[rows].float(), batch())]  # fmt: skip
        assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids, rows
        assert outs[0].logprobs == outs[1].logprobs


def test_prompt_logprobs_alike_with_and_without_the_kernels(ops: kernels.Kernels) -> None:
    """A prompt's logprobs (Sampler.logprobs_at: each position's target and top tokens) with the kernel and with
    torch's log_softmax: the same tokens, values to 1e-5."""
    scores = torch.randn(9, 500, generator=torch.Generator().manual_seed(4)) * 3
    targets = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    mine, theirs = Sampler(0, ops).logprobs_at(scores, targets, 2), Sampler(0).logprobs_at(scores, targets, 2)
    for a, b in zip(mine, theirs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)


def test_kernel_rejects_mismatched_rows(ops: kernels.Kernels) -> None:
    with pytest.raises(ValueError, match="one temperature"):
        ops.draw(torch.zeros(2, 8), [SP()], [0.5])
    with pytest.raises(ValueError, match="float32"):
        ops.draw(torch.zeros(2, 8, dtype=torch.float64), [SP()] * 2, [0.5] * 2)
    with pytest.raises(ValueError, match="outside the logits"):
        ops.logprobs(torch.zeros(2, 8), [2], [0], [1])

"""The decode stack's LM head hands the sampler more than logits: a bf16 model's logits widened to float32, and
every row's argmax, both made by the head's own chunks while their columns are in cache (kernels/csrc/stack/stack.h)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parity.test_models import PROMPT, SPREAD, _skip_without_stack
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.formats import FORMATS, pack

# 390: the head's last panel holds 6 columns (16 a panel), so its chunks end on a vocabulary tail
VOCAB = 390


class Runs:
    """Wraps a stack's checked native calls: each decode step's logits (model dtype), float32 logits and argmax."""

    def __init__(self, llm: LLM) -> None:
        _skip_without_stack(llm)
        self.stack = llm.engine.runner.decode_stack
        assert self.stack is not None and self.stack.vocab_size == VOCAB
        self.native = self.stack.native
        self.steps: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []  # wide None: not asked for
        self.stack.native = self  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.native, name)

    def step_tensors(self, *args: Any) -> None:  # (..., out, logits, wide, top)
        self.native.step_tensors(*args)
        self.record(*args[-3:])

    def step_lists(self, *args: Any) -> None:  # (..., out, logits, wide, top)
        self.native.step_lists(*args)
        self.record(*args[-3:])

    def record(self, logits: torch.Tensor, wide: torch.Tensor | None, top: torch.Tensor) -> None:
        bf16 = self.stack.kv.dtype == torch.bfloat16
        wide = logits if not bf16 else wide
        self.steps.append((logits.clone(), None if wide is None else wide.clone(), top.clone()))


def _llm(make_checkpoint: Callable[..., Path], dtype: str) -> LLM:
    """One step a call (no decode runs): these tests watch each step's head outputs (test_decode_runs.py checks
    that runs give the same tokens)."""
    folder = make_checkpoint("qwen2", **SPREAD, vocab_size=VOCAB)
    return LLM(str(folder), dtype=dtype, device="cpu", num_scheduler_steps=1)


def _generate(llm: LLM, logprobs: int | None = None) -> list[list[int]]:
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": ids[:n]} for n in (3, 7, 12)], params)]


def _set_head(llm: LLM, edit: Callable[[torch.Tensor], None]) -> None:
    """Rewrite the packed LM head in place (the stack holds its address): edit([V, K] float32) then pack again."""
    head, ops = llm.loaded.model.lm_head, llm.loaded.ops
    assert ops is not None
    w = ops.unpack(head.data, head.format_id, head.out_features, head.padded_in)[:, : head.in_features]
    edit(w)
    head.data.copy_(pack(w, next(f for f, i in FORMATS.items() if i == head.format_id)).data)


def test_the_stack_widens_a_bf16_models_logits_exactly(make_checkpoint: Callable[..., Path]) -> None:
    """A bf16 model's decode stack hands the sampler float32 logits, widened by the LM head's own chunks: each
    step's are exactly its bf16 logits as torch widens them (every row, every chunk and the vocabulary's tail)."""
    llm = _llm(make_checkpoint, "bfloat16")
    runs = Runs(llm)
    _generate(llm, logprobs=1)  # logprobs read the logits themselves
    assert runs.steps and max(len(top) for *_, top in runs.steps) == 3  # decode steps of three rows ran
    for logits, wide, _ in runs.steps:
        assert wide is not None and torch.equal(logits.float(), wide)


def test_a_step_that_reads_only_the_argmax_skips_the_float32_logits(make_checkpoint: Callable[..., Path]) -> None:
    """Greedy rows without logprobs, penalties, biases or a grammar read only each row's argmax: a bf16 model's
    stack then writes no float32 copy of the logits, and decodes the same tokens. A step with one row that reads
    its logits (here logprobs) widens them for all."""
    llm = _llm(make_checkpoint, "bfloat16")
    runs = Runs(llm)
    greedy = _generate(llm)
    assert runs.steps and all(wide is None for _, wide, _ in runs.steps)
    runs.steps.clear()
    assert _generate(llm, logprobs=0) == greedy
    assert runs.steps and all(wide is not None for _, wide, _ in runs.steps)
    runs.steps.clear()
    ids = llm.tokenizer.encode(PROMPT)
    mixed = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=lp) for lp in (None, 2)]
    outs = llm.generate([{"prompt_token_ids": ids[:n]} for n in (3, 7)], mixed)
    assert [o.outputs[0].token_ids for o in outs] == greedy[:2]
    assert runs.steps and all(wide is not None for _, wide, _ in runs.steps)


def test_a_drawing_step_draws_from_the_bf16_logits_as_from_float32(make_checkpoint: Callable[..., Path]) -> None:
    """Rows that only draw (no logprobs, penalty, bias or grammar) hand the draw kernel a bf16 model's logits as
    they are: no float32 copy, and the same seeded draws as where another row's logprobs widen them for all."""
    llm = _llm(make_checkpoint, "bfloat16")
    runs = Runs(llm)
    ids = llm.tokenizer.encode(PROMPT)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (3, 7, 12)]

    def drawn(logprobs: int | None) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, top_k=k, top_p=0.9, seed=i, max_tokens=6, ignore_eos=True,
                               logprobs=logprobs) for i, k in enumerate((0, 20, 50))]  # fmt: skip

    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, drawn(None))]
    assert runs.steps and all(wide is None for _, wide, _ in runs.steps)
    runs.steps.clear()
    widened = [o.outputs[0].token_ids for o in llm.generate(prompts, drawn(None)[:2] + drawn(0)[2:])]
    assert runs.steps and all(wide is not None for _, wide, _ in runs.steps)
    assert widened == plain
    assert len({tuple(t) for t in plain}) == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stacks_argmax_is_torchs_and_the_sampler_takes_it(make_checkpoint: Callable[..., Path], dtype: str) -> None:
    """Each head chunk takes its columns' argmax, and the chunks' winners are compared after: every step's is
    torch.argmax of the sampler's float32 logits, and greedy decoding emits it."""
    llm = _llm(make_checkpoint, dtype)
    runs = Runs(llm)
    outputs = _generate(llm)
    assert runs.steps
    for logits, _, top in runs.steps:
        assert torch.equal(top, logits.float().argmax(dim=-1))
    emitted = [tokens[1:] for tokens in outputs]  # each step's token, from the second (the first is the prefill's)
    for step, (_, _, top) in enumerate(runs.steps):
        assert top.tolist() == [tokens[step] for tokens in emitted]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stacks_argmax_keeps_torchs_ties_and_nans(make_checkpoint: Callable[..., Path], dtype: str) -> None:
    """Equal maxima in every chunk: the first column wins, as in torch. A NaN column: the first NaN wins, even in a
    later chunk than the largest value and ahead of a NaN in a later one."""
    llm = _llm(make_checkpoint, dtype)
    _set_head(llm, lambda w: w.copy_(w[5].expand_as(w)))  # every logit of a row equal
    runs = Runs(llm)
    assert all(set(tokens) == {0} for tokens in _generate(llm))
    assert all(torch.equal(top, torch.zeros_like(top)) for *_, top in runs.steps)

    def nans(w: torch.Tensor) -> None:
        torch.manual_seed(0)
        w.copy_(torch.randn_like(w))
        w[[VOCAB // 2, VOCAB - 3]] = float("nan")

    _set_head(llm, nans)
    runs.steps.clear()
    assert all(set(tokens[1:]) == {VOCAB // 2} for tokens in _generate(llm))
    for logits, _, top in runs.steps:
        assert torch.equal(top, logits.float().argmax(dim=-1)) and set(top.tolist()) == {VOCAB // 2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_embeds_and_rotates_as_torch_does(
    make_checkpoint: Callable[..., Path], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a plain embedding the stack gathers the token rows and the rotary tables' rows itself, from the step's
    inputs as lists (step_lists); the logits are the same bits as from torch's gathers and conversions, step
    by step."""
    llm = _llm(make_checkpoint, dtype)
    runs = Runs(llm)
    assert runs.stack.plain_embedding
    own = _generate(llm)
    own_steps, runs.steps = runs.steps, []
    monkeypatch.setattr(runs.stack, "plain_embedding", False)
    assert _generate(llm) == own
    assert len(runs.steps) == len(own_steps)
    for (logits, _, top), (torch_logits, _, torch_top) in zip(own_steps, runs.steps, strict=True):
        assert torch.equal(logits, torch_logits) and torch.equal(top, torch_top)


def test_the_stack_refuses_a_token_id_outside_the_embedding(make_checkpoint: Callable[..., Path]) -> None:
    """The native run_ids reads embedding rows by id: one past the table raises IndexError, as torch's embedding
    would, before anything runs, and the engine decodes on afterwards."""
    llm = _llm(make_checkpoint, "float32")
    _skip_without_stack(llm)
    stack = llm.engine.runner.decode_stack
    assert stack is not None
    embed = stack.decoder.embed_tokens.weight
    for bad in (VOCAB, -1):
        ids = torch.tensor([3, bad], dtype=torch.int64)
        with pytest.raises(IndexError, match=f"token id {bad} is not in the embedding's {VOCAB} rows"):
            stack.native.native.run_ids(embed.data_ptr(), VOCAB, ids.data_ptr(), *[0] * 7, 2, 16, 0, 0, 0, 0)
        with pytest.raises(IndexError, match=f"token id {bad} is not in the embedding's {VOCAB} rows"):
            stack.native.native.run_lists(embed.data_ptr(), VOCAB, [3, bad], [0, 0], 0, 0, [0, 1], [1, 1], 1, [1, 1],
                                          16, 0, 0, 0, 0)  # fmt: skip
    assert all(len(tokens) == 6 for tokens in _generate(llm))


@pytest.mark.parametrize(
    "lists",
    [([3], [0, 0], [0, 1], [1, 1], [1, 1]), ([3, 4], [0, 0], [0], [1, 1], [1, 1]),
     ([3, 4], [0, 0], [0, 1], [1], [1, 1]), ([3, 4], [0, 0], [0, 1], [1, 1], [1]), ([], [], [], [], [])],
)  # fmt: skip
def test_the_stacks_list_inputs_must_agree_in_length(
    make_checkpoint: Callable[..., Path], lists: tuple[list[int], ...]
) -> None:
    """The native run_lists takes ids, positions, slots [B], tables [B * max_blocks] and lens [B] as lists: lengths
    that do not agree (or no row) raise ValueError before anything runs, and the engine decodes on afterwards."""
    llm = _llm(make_checkpoint, "float32")
    _skip_without_stack(llm)
    stack = llm.engine.runner.decode_stack
    assert stack is not None
    ids, positions, slots, tables, lens = lists
    embed = stack.decoder.embed_tokens.weight
    with pytest.raises(ValueError, match="one entry per row"):
        stack.native.native.run_lists(
            embed.data_ptr(), VOCAB, ids, positions, 0, 0, slots, tables, 1, lens, 16, 0, 0, 0, 0
        )
    assert all(len(tokens) == 6 for tokens in _generate(llm))


def test_the_stacks_buffers_follow_the_batch_as_it_shrinks_and_grows(make_checkpoint: Callable[..., Path]) -> None:
    """step writes into buffers kept from step to step, grown to the most rows seen: batches that shrink as
    requests finish, then a larger one, decode the same tokens as the tensor path (run), which allocates afresh."""
    llm = _llm(make_checkpoint, "bfloat16")
    runs = Runs(llm)
    ids = llm.tokenizer.encode(PROMPT)

    def generate() -> list[list[int]]:  # 3 rows down to 1, then 5 rows
        first = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 5, 9)]
        outs = llm.generate([{"prompt_token_ids": ids[: 3 + n]} for n in range(3)], first)
        more = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs += llm.generate([{"prompt_token_ids": ids[: 2 + n]} for n in range(5)], more)
        return [o.outputs[0].token_ids for o in outs]

    own = generate()
    assert [len(t) for t in own] == [2, 5, 9] + [4] * 5
    assert sorted({step[2].shape[0] for step in runs.steps}) == [1, 2, 3, 5]
    assert runs.stack._capacity == 5
    runs.stack.plain_embedding = False  # run(): the rows gathered by torch, outputs allocated each step
    assert generate() == own


def test_the_checked_calls_refuse_what_would_read_or_write_outside(make_checkpoint: Callable[..., Path]) -> None:
    """kernels/stack_ops.py checks a step before any pointer crosses: a token id past the embedding, a position
    past the rotary tables, a slot or block id past the pool, and a buffer of the wrong shape are each a ValueError,
    and the engine decodes on afterwards."""
    llm = _llm(make_checkpoint, "float32")
    _skip_without_stack(llm)
    stack = llm.engine.runner.decode_stack
    assert stack is not None
    native, pool = stack.native, stack.kv
    embed, (cos, sin) = stack.decoder.embed_tokens.weight, stack.decoder.rotary.tables(8)
    d, slots_in_pool = embed.shape[1], pool.cache.shape[2]
    out, logits = torch.empty(2, d), torch.empty(2, VOCAB)

    def step(ids: list[int], positions: list[int], slots: list[int], tables: list[int], buf: torch.Tensor) -> None:
        native.step_lists(embed, ids, positions, cos, sin, slots, tables, 1, [1, 1], pool.block_size, buf, logits,
                          None, None)  # fmt: skip

    cases = [(([3, VOCAB], [0, 0], [0, 1], [0, 0], out), "token ids"),
             (([3, 4], [0, cos.shape[0]], [0, 1], [0, 0], out), "positions"),
             (([3, 4], [0, 0], [0, slots_in_pool], [0, 0], out), "slots"),
             (([3, 4], [0, 0], [0, 1], [0, slots_in_pool // pool.block_size], out), "block ids"),
             (([3, 4], [0, 0], [0, 1], [0, 0], torch.empty(2, d + 1)), "out must be")]  # fmt: skip
    for args, what in cases:
        with pytest.raises(ValueError, match=what):
            step(*args)
    assert all(len(tokens) == 6 for tokens in _generate(llm))

"""The batched sampler. One call handles every row of the batch with tensors; per-row Python is limited to
seeded random draws and building the logprob dicts the caller asked for.

Order (as Hugging Face / vLLM): grammar bitmask (structured output) -> suppress tokens (min_tokens) ->
repetition, presence and frequency penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.
A draw is an inverse transform: one uniform number per row (a seeded row's from its own generator, so it draws
the same whatever the batch), and the first token whose running sum of probabilities passes it. top-k and top-p
(filters.py) look among each row's most likely tokens (a partial sort, `torch.topk`, `CANDIDATES`) and sort whole
rows only where a row may keep tokens past them (a wide nucleus, or ties with the last token kept). With a 152k
vocabulary, one row (Zen 4, 2 threads), the exponential race this replaced drew 152k exponentials (~3 ms), and top-k
and top-p sorted the row (~12-25 ms).

On the CPU the logits after the masks, biases and penalties go to one kernel call instead (kernels/csrc/ops/sample.h:
the same rules, tested against this code; a bf16 model's logits as they are where the step's plan says nothing
but a draw reads them), and the logprobs asked for to another (logprobs.h): 0.07-0.4 ms a row of 152k where the
torch ops took 0.5-17 ms. The kernel's top-p sums in float64 where this code's running sums are float32, so a
nucleus within ~1e-6 of the whole row may keep a few tokens more or fewer here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.sampling.batch import SamplingBatch
from tokenmill.sampling.filters import apply_filters
from tokenmill.types import LogitsRead

if TYPE_CHECKING:
    from tokenmill.kernels.ops import Kernels


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B]
    logprobs: list[dict[int, float] | None]  # [B]: sampled token + top-k, where asked for


def _token_mask(rows: Sequence[list[int]], vocab: int, device: torch.device) -> torch.Tensor | None:
    """[B, V] counts of each token id per row (None when every row is empty)."""
    if not any(rows):
        return None
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), vocab, dtype=torch.int64, device=device)  # pad with an extra column
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64, device=device)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:  # [B, V], [B, W] -> [B, V]
    """Tokens whose bit is clear become -inf (a grammar forbids them); tokens past the mask's width too."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)  # [B, 32 W]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [B, V] -> [B, V]
    if not batch.penalized:
        return logits
    vocab, device = logits.shape[1], logits.device
    if bool((batch.repetition_penalty != 1).any()):
        seen = _token_mask([p + o for p, o in zip(batch.prompt_token_ids, batch.output_token_ids)], vocab, device)
        if seen is not None:
            penalty = batch.repetition_penalty[:, None]
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen > 0, penalized, logits)
    if bool((batch.presence_penalty != 0).any() or (batch.frequency_penalty != 0).any()):
        counts = _token_mask(batch.output_token_ids, vocab, device)
        if counts is not None:
            logits = logits - batch.frequency_penalty[:, None] * counts
            logits = logits - batch.presence_penalty[:, None] * (counts > 0).float()
    return logits


def topk_logprobs(
    logprobs: torch.Tensor,  # [N, V]
    token_ids: torch.Tensor,  # [N]
    num_top: Sequence[int],  # [N] how many top entries each row wants
) -> list[dict[int, float]]:
    """Per row: {chosen token: logprob} plus that row's most likely tokens."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    k_max = min(max(num_top, default=0), logprobs.shape[-1])
    top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    rows: list[dict[int, float]] = []
    for i, tok in enumerate(token_ids.tolist()):
        row = {tok: chosen[i]}
        row.update(zip(top_ids_l[i][: num_top[i]], top_vals_l[i][: num_top[i]]))
        rows.append(row)
    return rows


def _scaled(logits: torch.Tensor, batch: SamplingBatch, greedy: bool) -> torch.Tensor:  # [B, V] -> [B, V]
    """The logits over each drawing row's temperature (greedy rows' as they are): on the CPU one temperature for
    the batch divides by a number, 1 not at all (the filters and the softmax make new tensors; the caller's stay).
    A GPU divides by a number as a product with its reciprocal, which rounds differently from a division by a
    tensor: there every batch divides by the column, so that a row's numbers do not depend on the batch."""
    temperatures = {p.temperature for p in batch.params}
    if greedy or len(temperatures) > 1 or logits.device.type != "cpu":
        return logits / torch.where(batch.temperature > 0, batch.temperature, 1.0)[:, None]
    (t,) = temperatures
    return logits if t == 1 else logits / t


def inverse_transform(
    weights: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:  # [B, V], [B] in [0, 1) -> [B]
    """Each row's token (int64) at u: the first whose running sum of weights (probabilities, not necessarily
    normalised) exceeds u times the row's total. The sums are float64: in float32 past a sum of 0.5 a token below
    ~3e-8 would add nothing and never be drawn (152k tokens of 3-sigma logits: 43k of them). A token of weight 0
    never is drawn (the sum does not rise there); where u times the total rounds up to the total itself, the token
    at which the sums reach it. `out`: float64 storage of at least B * V for the sums (a fresh [B, V] float64 each
    step costs page faults: ~1 ms at one row of 152k on a Zen 4)."""
    flat = torch.empty(weights.numel(), dtype=torch.float64, device=weights.device) if out is None else out
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64, out=flat[: weights.numel()].view(weights.shape))
    total = cdf[:, -1:]  # [B, 1]
    index = torch.searchsorted(cdf, u.to(device=cdf.device, dtype=cdf.dtype)[:, None] * total, right=True).squeeze(1)
    if int(index.max()) >= cdf.shape[1]:  # some row where nothing exceeds the target
        index = torch.where(index >= cdf.shape[1], (cdf < total).sum(dim=-1), index)
    return index


def _biased(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:  # [B, V] -> [B, V]
    logits = logits.clone()
    for i, bias in enumerate(biases):
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def _only(row: torch.Tensor, ids: list[int]) -> bool:
    """Nothing but `ids` is allowed in this row (a grammar that can only end): suppressing them would leave no
    token, so min_tokens yields to the grammar."""
    rest = row.clone()
    rest[ids] = float("-inf")
    return bool(torch.isneginf(rest).all())


class Sampler:
    def __init__(self, seed: int = 0, ops: Kernels | None = None) -> None:
        self.default_generator = torch.Generator().manual_seed(seed)  # rows without a seed of their own
        self.ops = ops  # the CPU kernels: the grammar bitmask, the greedy argmax and the draws (torch's otherwise)
        self._cdf: torch.Tensor | None = None  # the draws' running sums (float64), grown to the most rows seen

    def _kernels(self, logits: torch.Tensor) -> Kernels | None:
        """The CPU kernels, where they take these logits (on the CPU: float32, and bfloat16 for a draw); the torch
        code is their reference."""
        return self.ops if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) else None

    def _masked(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        if (ops := self._kernels(logits)) is not None:
            out = logits.clone()
            ops.apply_bitmask(out, bitmask)
            return out
        return apply_bitmask(logits, bitmask)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
        ops = self._kernels(logits)
        return ops.argmax(logits) if ops is not None else logits.argmax(dim=-1)

    def __call__(
        self, logits: torch.Tensor | None, batch: SamplingBatch, argmax: torch.Tensor | None = None
    ) -> SamplerOutput:
        """logits [B, V] (float32, or the model's dtype where the plan reads them for a draw at most) -> each row's
        token. `argmax` [B] int64, where the caller has it: the logits' own argmax (as torch.argmax), taken instead
        of another pass over them where no mask, bias or penalty changes the logits; with it, logits may be None
        where the plan reads only the argmax."""
        if logits is None:  # the caller kept only the argmax (the plan's LogitsRead.ARGMAX)
            # the batch's own flags: a row that reads its logits must have been handed them
            reads = batch.sampled or batch.penalized or batch.logit_bias is not None or batch.bitmask is not None
            assert argmax is not None and not reads and not any(batch.suppressed_token_ids)
            assert all(n is None for n in batch.num_logprobs)
            return SamplerOutput(token_ids=argmax.tolist(), logprobs=[None] * len(batch.params))
        draw_only = batch.reads <= LogitsRead.DRAW
        if logits.dtype != torch.float32 and not (batch.sampled and draw_only and self._kernels(logits) is not None):
            logits = logits.float()  # [B, V]: only the draw kernel reads the model's dtype
        raw = logits
        if batch.bitmask is not None:
            logits = self._masked(logits, batch.bitmask)
        if any(batch.suppressed_token_ids):
            logits = logits.clone()
            for i, ids in enumerate(batch.suppressed_token_ids):
                if ids and not (batch.bitmask is not None and _only(logits[i], ids)):
                    logits[i, ids] = float("-inf")
        if batch.logit_bias is not None:
            logits = _biased(logits, batch.logit_bias)
        logits = apply_penalties(logits, batch)
        if batch.sampled and (ops := self._kernels(logits)) is not None:  # every row (greedy: argmax) in one call
            token_ids = ops.draw(logits, batch.params, self.uniforms(batch.generators))
            return SamplerOutput(token_ids=token_ids, logprobs=self._logprobs(raw, token_ids, batch))
        greedy = not batch.sampled or any(p.temperature <= 0 for p in batch.params)  # some row takes the argmax
        tokens = argmax if argmax is not None and logits is raw else self._argmax(logits) if greedy else None  # [B]
        if batch.sampled:
            probs = apply_filters(_scaled(logits, batch, greedy), batch).softmax(dim=-1)  # [B, V]
            drawn = inverse_transform(probs, self._uniforms(batch.generators), self._sums(probs))  # [B]
            tokens = drawn if tokens is None else torch.where(batch.temperature > 0, drawn, tokens)
        assert tokens is not None  # every row either drew or took the argmax
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids=token_ids, logprobs=self._logprobs(raw, token_ids, batch))

    def _sums(self, probs: torch.Tensor) -> torch.Tensor:  # -> float64 [>= B * V], kept from call to call
        if self._cdf is None or self._cdf.numel() < probs.numel() or self._cdf.device != probs.device:
            self._cdf = torch.empty(probs.numel(), dtype=torch.float64, device=probs.device)
        return self._cdf

    def uniforms(self, generators: list[torch.Generator | None]) -> list[float]:
        """The uniform numbers a step that draws takes, one per row (a decode run's steps each take theirs)."""
        return self._uniforms(generators).tolist()

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:  # -> [B] float64 in [0, 1)
        """One uniform number per row: a seeded row's from its own generator, the others' from the sampler's. Drawn
        on the CPU, so that seeds reproduce on any device."""
        u = torch.empty(len(generators), dtype=torch.float64).uniform_(generator=self.default_generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                u[i : i + 1].uniform_(generator=gen)
        return u

    def logprobs_at(self, scores: torch.Tensor, token_ids: list[int], num_top: int) -> list[dict[int, float]]:
        """scores [N, V] (a prompt's logits) -> each row's {token: logprob} at token_ids[n] and at its num_top most
        likely tokens: on the CPU by the kernel, without writing the [N, V] log-softmax."""
        if (ops := self._kernels(scores)) is not None:
            return ops.logprobs(scores, range(len(token_ids)), token_ids, [num_top] * len(token_ids))
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=scores.device)
        return topk_logprobs(scores.log_softmax(dim=-1), tokens, [num_top] * len(token_ids))

    def _logprobs(self, raw: torch.Tensor, token_ids: list[int], batch: SamplingBatch) -> list[dict[int, float] | None]:
        wanted = [i for i, k in enumerate(batch.num_logprobs) if k is not None]
        out: list[dict[int, float] | None] = [None] * len(batch.num_logprobs)
        if not wanted:
            return out
        num_top = [batch.num_logprobs[i] or 0 for i in wanted]
        if (ops := self._kernels(raw)) is not None:
            dicts = ops.logprobs(raw, wanted, [token_ids[i] for i in wanted], num_top)
        else:
            rows = torch.tensor(wanted, device=raw.device)
            tokens = torch.tensor([token_ids[i] for i in wanted], dtype=torch.int64, device=raw.device)
            dicts = topk_logprobs(raw[rows].log_softmax(dim=-1), tokens, num_top)
        for i, d in zip(wanted, dicts):
            out[i] = d
        return out

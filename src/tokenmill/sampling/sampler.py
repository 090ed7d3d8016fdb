"""The batched sampler. One call handles every row of the batch with tensors; per-row Python is limited to
seeded random draws and building the logprob dicts the caller asked for.

Order (as Hugging Face / vLLM): grammar bitmask (structured output) -> suppress tokens (min_tokens) ->
repetition, presence and frequency penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.
Draws use the exponential-race trick (argmax of p / q with q ~ Exp(1)), which lets each seeded row use its own
generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.kernels.ops import Kernels


def _penalizes(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def reads_logits(params: Sequence[SamplingParams], suppressed_token_ids: Sequence[list[int]], grammar: bool) -> bool:
    """Whether sampling these rows reads their logits, rather than only each row's argmax: a draw, logprobs, a
    penalty, a logit bias, suppressed tokens or a grammar. `Sampler.__call__` takes the argmax alone otherwise."""
    return grammar or any(suppressed_token_ids) or any(
        p.temperature > 0 or p.logprobs is not None or p.logit_bias or _penalizes(p) for p in params
    )  # fmt: skip


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors ([B] each) plus the token history penalties need. The tensors are made
    on first use: a step of greedy rows without penalties reads none of them (building them was ~0.1 ms a step)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    suppressed_token_ids: list[list[int]]  # per row: ids that must not be sampled this step
    num_logprobs: list[int | None]
    device: torch.device | str = "cpu"
    bitmask: torch.Tensor | None = None  # [B, W] int32, bit t of row b set = token t allowed; None: no grammar
    logit_bias: list[dict[int, float] | None] | None = None  # per row: token id -> added to its logit
    # NOTE: decided from the parameters, so a plain greedy step runs no tensor test of the columns below
    penalized: bool = True  # some row has a repetition, presence or frequency penalty
    sampled: bool = True  # some row draws (temperature > 0)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[list[int]],
        output_token_ids: Sequence[list[int]],
        generators: Sequence[torch.Generator | None],
        suppressed_token_ids: Sequence[list[int]],
        device: torch.device | str = "cpu",
        bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        return cls(
            params=list(params),
            generators=list(generators),
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            suppressed_token_ids=list(suppressed_token_ids),
            num_logprobs=[p.logprobs for p in params],
            device=device,
            bitmask=None if bitmask is None else bitmask.to(device),
            logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else None,
            penalized=any(_penalizes(p) for p in params),
            sampled=any(p.temperature > 0 for p in params),
        )

    @cached_property
    def _floats(self) -> torch.Tensor:  # [6, B]: one tensor, its rows are the float columns below
        return torch.tensor(
            [[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty]
             for p in self.params], dtype=torch.float32,
        ).T.to(self.device)  # fmt: skip

    @cached_property
    def top_k(self) -> torch.Tensor:  # [B] int64, 0 when off
        return torch.tensor([max(p.top_k, 0) for p in self.params], dtype=torch.int64, device=self.device)

    # [B] float32 each, rows of _floats (temperature: 0 for greedy rows)
    temperature = property(lambda self: self._floats[0])
    top_p = property(lambda self: self._floats[1])
    min_p = property(lambda self: self._floats[2])
    repetition_penalty = property(lambda self: self._floats[3])
    presence_penalty = property(lambda self: self._floats[4])
    frequency_penalty = property(lambda self: self._floats[5])


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


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [B, V] -> [B, V]
    """top-k, top-p and min-p on temperature-scaled logits; filtered entries become -inf."""
    use_top_k, use_top_p = bool((batch.top_k > 0).any()), bool((batch.top_p < 1).any())
    if use_top_k or use_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
            k = torch.where(batch.top_k > 0, batch.top_k, logits.shape[1])[:, None]
            drop |= rank >= k
        if use_top_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= (mass_before >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None]  # top_p=1 rows: off
        drop[:, 0] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if bool((batch.min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
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
        self.ops = ops  # the CPU kernels, for the grammar bitmask and the greedy argmax (torch's otherwise)

    def _masked(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
            out = logits.clone()
            self.ops.apply_bitmask(out, bitmask)
            return out
        return apply_bitmask(logits, bitmask)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
        if self.ops is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
            return self.ops.argmax(logits)
        return logits.argmax(dim=-1)

    def __call__(
        self, logits: torch.Tensor | None, batch: SamplingBatch, argmax: torch.Tensor | None = None
    ) -> SamplerOutput:
        """logits [B, V] float32 -> each row's token. `argmax` [B] int64, where the caller has it: the logits'
        own argmax (as torch.argmax), taken instead of another pass over them where no mask, bias or penalty
        changes the logits; with it, logits may be None where no row reads them (`reads_logits`)."""
        if logits is None:  # the caller kept only the argmax (reads_logits: False for every row)
            # the batch's own flags, not reads_logits again: the runner has just asked that of the same rows
            reads = batch.sampled or batch.penalized or batch.logit_bias is not None or batch.bitmask is not None
            assert argmax is not None and not reads and not any(batch.suppressed_token_ids)
            assert all(n is None for n in batch.num_logprobs)
            return SamplerOutput(token_ids=argmax.tolist(), logprobs=[None] * len(batch.params))
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
        tokens = argmax if argmax is not None and logits is raw else self._argmax(logits)  # [B], final for greedy rows
        if batch.sampled:
            sampled_rows = batch.temperature > 0
            temperature = torch.where(sampled_rows, batch.temperature, 1.0)[:, None]
            probs = apply_filters(logits / temperature, batch).softmax(dim=-1)  # [B, V]
            race = probs / self._exponentials(probs, batch.generators)
            tokens = torch.where(sampled_rows, race.argmax(dim=-1), tokens)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=self._logprobs(raw, tokens, batch))

    def _exponentials(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        q = torch.empty(probs.shape, dtype=torch.float32)  # drawn on CPU so seeds reproduce on any device
        q.exponential_(generator=self.default_generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                q[i].exponential_(generator=gen)
        return q.to(probs.device)

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[dict[int, float] | None]:
        wanted = [i for i, k in enumerate(batch.num_logprobs) if k is not None]
        out: list[dict[int, float] | None] = [None] * len(batch.num_logprobs)
        if not wanted:
            return out
        rows = torch.tensor(wanted, device=raw.device)
        num_top = [batch.num_logprobs[i] or 0 for i in wanted]
        for i, d in zip(wanted, topk_logprobs(raw[rows].log_softmax(dim=-1), tokens[rows], num_top)):
            out[i] = d
        return out

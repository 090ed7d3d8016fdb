"""The batched sampler. One call handles every row of the batch with tensors; per-row Python is limited to
seeded random draws and building the logprob dicts the caller asked for.

Order (as Hugging Face / vLLM): grammar bitmask (structured output) -> suppress tokens (min_tokens) ->
repetition, presence and frequency penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.
A draw is an inverse transform: one uniform number per row (a seeded row's from its own generator, so it draws
the same whatever the batch), and the first token whose running sum of probabilities passes it. top-k and top-p
look among each row's most likely tokens (a partial sort, `torch.topk`, `CANDIDATES`) and sort whole rows only
where a nucleus reaches past them. With a 152k vocabulary, one row (Zen 4, 2 threads), the exponential race this
replaced drew 152k exponentials (~3 ms), and top-k and top-p sorted the row (~12-25 ms).
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
    # NOTE: decided from the parameters, so that a step runs no tensor test of the columns below (after a step's
    # weights have streamed through the caches, every torch op's first call is cold: tens of us)
    penalized: bool = True  # some row has a repetition, presence or frequency penalty
    sampled: bool = True  # some row draws (temperature > 0)
    top_k_rows: bool = True  # some row has a top-k
    top_p_rows: bool = True  # some row has a top-p below 1
    min_p_rows: bool = True  # some row has a min-p

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
            top_k_rows=any(p.top_k > 0 for p in params),
            top_p_rows=any(p.top_p < 1 for p in params),
            min_p_rows=any(p.min_p > 0 for p in params),
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


# how many of each row's most likely tokens top-p looks among first, then (if some row's nucleus reaches past them)
# next; past those, it sorts whole rows. A vocabulary of 152k, one row (Zen 4, 2 threads): topk of 41 or 256
# tokens 0.3 ms, of 4096 1.3 ms, a whole sort 12.5 ms.
CANDIDATES = (256, 4096)


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [B, V] -> [B, V]
    """top-k, top-p and min-p on temperature-scaled logits; filtered entries become -inf."""
    use_top_k, use_top_p = batch.top_k_rows, batch.top_p_rows
    if use_top_k or use_top_p:
        vocab, k = logits.shape[1], int(batch.top_k.max()) + 1  # + 1: a tie with the k-th shows
        widths = [max(w, k) for w in CANDIDATES] if use_top_p else [k, max(CANDIDATES[-1], k)]
        for width in dict.fromkeys([*(w for w in widths if w < vocab), vocab]):  # the fewest that hold every row's
            values, order = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
            drop = _nucleus_drops(values, logits, batch, use_top_k, use_top_p)  # [B, width], or None: too few
            if drop is not None:
                break
        assert drop is not None  # the last width is the whole vocabulary
        drop[:, 0] = False  # always keep the most likely token
        # the kept candidates in place, every other token -inf, but for rows without a filter: those stay whole
        filtered = torch.full_like(logits, float("-inf")).scatter_(1, order, values.masked_fill(drop, float("-inf")))
        unfiltered = (batch.top_k <= 0) & (batch.top_p >= 1)  # [B]
        if bool(unfiltered.any()):
            filtered[unfiltered] = logits[unfiltered]
        logits = filtered
    if batch.min_p_rows:  # p < min_p * p_max, in logits: l < l_max + log(min_p) (log 0 = -inf: off)
        floor = logits.amax(dim=-1, keepdim=True) + batch.min_p[:, None].log()
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def _nucleus_drops(
    values: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch, use_top_k: bool, use_top_p: bool
) -> torch.Tensor | None:
    """values [B, k]: each row's k largest logits, most likely first (k = V: the whole row, sorted) -> which of them
    top-k and top-p drop [B, k] bool; None where a row may keep tokens past the k (the caller sorts whole rows then).
    Tokens past the k are all dropped in a row that filters: a top-k row keeps its k largest and any tied with the
    k-th (as transformers' top-k does), a top-p row the fewest whose mass reaches p."""
    vocab, width = logits.shape[1], values.shape[1]
    drop = torch.zeros_like(values, dtype=torch.bool)
    if use_top_k:
        on = batch.top_k > 0  # [B]
        kth = values.gather(1, (torch.where(on, batch.top_k, width).clamp(max=width) - 1)[:, None])  # [B, 1]
        if width < vocab and bool((on & (values[:, -1] == kth[:, 0])).any()):  # ties with the k-th run past the k
            return None
        drop |= (values < kth) & on[:, None]
    if use_top_p:
        # each candidate's share of the row's whole mass after top-k: a top-k row's mass lies in its candidates,
        # another row's over the whole vocabulary
        kept = values.masked_fill(drop, float("-inf"))
        total = torch.where(batch.top_k > 0, kept.logsumexp(dim=-1), logits.logsumexp(dim=-1))  # [B]
        probs = (kept - total[:, None]).exp()  # [B, k]
        mass_before = probs.cumsum(dim=-1) - probs
        nucleus = batch.top_p < 1  # top_p = 1 rows: off
        if width < vocab and bool((nucleus & (mass_before[:, -1] + probs[:, -1] < batch.top_p)).any()):
            return None
        drop |= (mass_before >= batch.top_p[:, None]) & nucleus[:, None]
    return drop


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
    """The logits over each drawing row's temperature (greedy rows' as they are): one temperature for the batch
    divides by a number, 1 not at all (the filters and the softmax make new tensors; the caller's stay)."""
    temperatures = {p.temperature for p in batch.params}
    if greedy or len(temperatures) > 1:
        return logits / torch.where(batch.temperature > 0, batch.temperature, 1.0)[:, None]
    (t,) = temperatures
    return logits if t == 1 else logits / t


def inverse_transform(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [B, V], [B] in [0, 1) -> [B]
    """Each row's token (int64) at u: the first whose running sum of weights (probabilities, not necessarily
    normalised) exceeds u times the row's total. A token of weight 0 never is (the sum does not rise there); where
    rounding puts u times the total at the total itself, the row's last token of any weight. `weights` is
    overwritten by its running sums (a [B, V] buffer fewer: at 16 rows of 152k, each costs ~1 ms of page faults)."""
    cdf = weights.cumsum_(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    index = torch.searchsorted(cdf, u.to(device=cdf.device, dtype=cdf.dtype)[:, None] * total, right=True).squeeze(1)
    if int(index.max()) >= cdf.shape[1]:  # some row where nothing exceeds the target
        index = torch.where(index >= cdf.shape[1], (cdf < total).sum(dim=-1), index)  # where the sums reach the total
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
        greedy = not batch.sampled or any(p.temperature <= 0 for p in batch.params)  # some row takes the argmax
        tokens = argmax if argmax is not None and logits is raw else self._argmax(logits) if greedy else None  # [B]
        if batch.sampled:
            probs = apply_filters(_scaled(logits, batch, greedy), batch).softmax(dim=-1)  # [B, V]
            drawn = inverse_transform(probs, self._uniforms(batch.generators))  # [B]
            tokens = drawn if tokens is None else torch.where(batch.temperature > 0, drawn, tokens)
        assert tokens is not None  # every row either drew or took the argmax
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=self._logprobs(raw, tokens, batch))

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:  # -> [B] float32 in [0, 1)
        """One uniform number per row: a seeded row's from its own generator, the others' from the sampler's. Drawn
        on the CPU, so that seeds reproduce on any device."""
        u = torch.empty(len(generators)).uniform_(generator=self.default_generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                u[i : i + 1].uniform_(generator=gen)
        return u

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

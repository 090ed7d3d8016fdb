"""top-k, top-p and min-p over a batch's temperature-scaled logits, each row's kept tokens its own (sampler.py's
order puts them after the penalties and the temperature)."""

from __future__ import annotations

import torch

from tokenmill.sampling.batch import SamplingBatch

# How many of each row's most likely tokens (`torch.topk`) the filters look among, first, then if some row may
# keep tokens past them; past those, whole rows are sorted. top-p starts at the first, top-k alone at its largest k
# (+ 1, so that a tie with the k-th shows). A vocabulary of 152k, one row (Zen 4, 2 threads): topk of 41 or 256
# tokens 0.3 ms, of 4096 1.3 ms, a whole sort 12.5 ms.
CANDIDATES = (256, 4096)


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [B, V] -> [B, V]
    """top-k, top-p and min-p on temperature-scaled logits; filtered entries become -inf. A row's kept tokens
    depend on that row alone (a seeded row draws the same whatever the batch): a top-k keeps every token tied with
    its k-th (as transformers' does), a top-p every token tied with the last one its nucleus needs."""
    vocab = logits.shape[1]
    drawing = [p for p in batch.params if p.temperature > 0]  # greedy rows' filters change nothing they take
    use_top_k = any(0 < p.top_k < vocab for p in drawing)
    use_top_p = any(p.top_p < 1 for p in drawing)
    if use_top_k or use_top_p:
        k = max((p.top_k for p in drawing if 0 < p.top_k < vocab), default=0) + 1
        widths = [max(w, k) for w in CANDIDATES] if use_top_p else [k, max(CANDIDATES[-1], k)]
        rows = _FilterRows(logits, batch, use_top_k, use_top_p)
        for width in dict.fromkeys([*(w for w in widths if w < vocab), vocab]):
            values, order = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
            drop = rows.drops(values)  # [B, width], or None: some row may keep tokens past these
            if drop is not None:
                break
        assert drop is not None  # the last width is the whole vocabulary
        # the kept candidates in place, every other token -inf, but for rows without a filter: those stay whole
        filtered = torch.full_like(logits, float("-inf")).scatter_(1, order, values.masked_fill(drop, float("-inf")))
        if bool(rows.unfiltered.any()):
            filtered[rows.unfiltered] = logits[rows.unfiltered]
        logits = filtered
    if batch.min_p_rows:  # p < min_p * p_max, in logits: l < l_max + log(min_p) (log 0 = -inf: off)
        floor = logits.amax(dim=-1, keepdim=True) + batch.min_p[:, None].log()
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


class _FilterRows:
    """Which of a row's most likely tokens top-k and top-p drop, whatever the number of them looked among."""

    def __init__(self, logits: torch.Tensor, batch: SamplingBatch, use_top_k: bool, use_top_p: bool) -> None:
        self.logits, self.batch, self.use_top_k, self.use_top_p = logits, batch, use_top_k, use_top_p
        vocab, drawing = logits.shape[1], batch.temperature > 0  # [B]
        self.top_k = drawing & (batch.top_k > 0) & (batch.top_k < vocab)  # [B]: rows with a top-k
        self.top_p = drawing & (batch.top_p < 1)  # [B]: rows with a top-p
        self.unfiltered = ~(self.top_k | self.top_p)  # [B]
        self._total: torch.Tensor | None = None

    def drops(self, values: torch.Tensor) -> torch.Tensor | None:
        """values [B, W]: each row's W largest logits, most likely first (W = V: whole rows) -> which of them are
        dropped [B, W] bool (never the first); None where a row may keep tokens past the W."""
        vocab, width = self.logits.shape[1], values.shape[1]
        drop = torch.zeros_like(values, dtype=torch.bool)
        kth = None
        if self.use_top_k:
            kth = values.gather(1, (torch.where(self.top_k, self.batch.top_k, width).clamp(max=width) - 1)[:, None])
            # a tie with the k-th at the last candidate may continue past them (a -inf k-th: a grammar's mask)
            if width < vocab and bool((self.top_k & (values[:, -1] == kth[:, 0]) & kth[:, 0].isfinite()).any()):
                return None
            drop |= (values < kth) & self.top_k[:, None]
        if self.use_top_p:
            probs = (values.masked_fill(drop, float("-inf")) - self.total(kth)[:, None]).exp()  # [B, W]
            mass_before = probs.cumsum(dim=-1) - probs
            cut = (mass_before >= self.batch.top_p[:, None]) & self.top_p[:, None]  # [B, W]: past the nucleus
            last = values.gather(1, (~cut).sum(dim=-1, keepdim=True) - 1)  # [B, 1]: the nucleus's last value
            if width < vocab and bool((self.top_p & ~cut[:, -1] | self.top_p & (values[:, -1] == last[:, 0])).any()):
                return None  # the nucleus, or a tie with its last token, may reach past the candidates
            drop |= (values < last) & self.top_p[:, None]
        drop[:, 0] = False  # always keep the most likely token
        return drop

    def total(self, kth: torch.Tensor | None) -> torch.Tensor:  # -> [B]
        """Each row's log of its whole mass after its top-k, over its whole row (a sum over the candidates alone
        would round differently with their number)."""
        if self._total is None:
            logits = self.logits
            if kth is not None and bool(self.top_k.any()):
                logits = logits.masked_fill((logits < kth) & self.top_k[:, None], float("-inf"))
            self._total = logits.logsumexp(dim=-1)
        return self._total

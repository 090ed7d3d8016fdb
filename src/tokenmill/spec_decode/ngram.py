"""N-gram (prompt lookup) proposer: no draft model. The sequence's last n tokens are looked up earlier in the
same sequence (prompt and output so far); the tokens that followed the most recent match are the drafts.
n goes from `n_max` down to `n_min`, so the longest match wins. Pays off on text grounded in its input
(editing, summarising, code), costs one short search per step where nothing matches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.spec_decode.request import DraftRequest


class NgramProposer:
    def __init__(self, num_tokens: int, n_min: int = 1, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram_prompt_lookup_min={n_min} / max={n_max}: allowed 1 <= min <= max")
        self.num_tokens, self.n_min, self.n_max = num_tokens, n_min, n_max

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) drafts to follow `token_ids`, or [] when the suffix occurs nowhere."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        length = len(token_ids)
        if k <= 0 or length < self.n_min + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            # windows [i, i + n) that end before the suffix itself starts: at least one token follows each
            windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)  # [length - n, n]
            hits = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match
                return ids[start : start + k].tolist()
        return []

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        return {r.request_id: self.propose(r.token_ids, r.limit) for r in requests}

    def release(self, request_id: str) -> None:
        pass  # keeps nothing per request

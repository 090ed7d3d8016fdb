"""Embeddings yield to decoding streams: while generation sequences decode, pooling prompts (embedding, score and
rerank requests) compute at most as many tokens a step as take `share` of a decode step's time, so each stream's
TPOT stays within about 1 + share of what it is without them (issue 58's mixed load: 1.5x; the default 0.4 leaves
room for the estimates' lag, which let 0.5 reach 1.53x).

A pooling prompt has no reader waiting on its tokens one by one, while every decoding stream waits on each step;
left alone, a 128-token embedding joins a 16-row decode step and makes it several times longer (Zen 3, 0.5B: a
128-token prompt ~0.6 s of arithmetic against a ~0.23 s step). The budget comes from the steps' own times, as the
scheduler's owner measures them (`observe`):
- `decode_s`: a step of decodes alone (a decode run's time over its steps);
- `token_s`: a prompt token's time, from steps that computed prompt tokens: what the step took beyond `decode_s`
  (all of it where nothing decoded), over those tokens.
Both are moving averages. Before both are measured the budget is `first_tokens`; it never goes under
`min_tokens` (one token), so an embedding always moves on. A floor of 16 tokens had let a 4-stream step on the Zen 3
grow 2.7x (16 prompt tokens there cost ~75 ms against a ~45 ms step).

The price is the embeddings' latency while streams decode: they take what is left, and catch up once the streams
end (Zen 3, 0.5B bf16, 4 streams and two 128-token embeddings a second, share 0.4: TPOT at most 1.37-1.38x of its own
against up to 2.14x without, embedding latency p50 ~2.5 s against ~0.4 s; docs/benchmarks.md). `--pooling-share 0`
turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.25  # weight of the newest step in each moving average


@dataclass
class PoolingShare:
    share: float  # the most of a decode step's time that pooling prompts may add to it
    min_tokens: int = 1  # pooling prompt tokens a step always may take
    first_tokens: int = 16  # until the step times are known
    decode_s: float | None = None
    token_s: float | None = None

    def observe(self, duration_s: float, num_steps: int, decode_rows: int, prompt_tokens: int) -> None:
        """A step that took `duration_s` for `num_steps` decode steps of `decode_rows` rows and `prompt_tokens` prompt
        (prefill, pooling or draft) tokens."""
        if duration_s <= 0 or (decode_rows == 0 and prompt_tokens == 0):
            return
        if prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, duration_s / max(1, num_steps))
        elif decode_rows == 0 or self.decode_s is not None:
            beyond = duration_s - (self.decode_s or 0.0) if decode_rows else duration_s
            self.token_s = _average(self.token_s, max(0.0, beyond) / prompt_tokens)

    def budget(self) -> int:
        """The pooling prompt tokens the next step may take while generation sequences decode."""
        if self.decode_s is None or not self.token_s:
            return max(self.min_tokens, self.first_tokens)
        return max(self.min_tokens, int(self.share * self.decode_s / self.token_s))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new

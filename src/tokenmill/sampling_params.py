"""How to pick tokens for one request. Mirrors vLLM's `SamplingParams`; every value is validated on creation.

Semantics:
- `temperature=0` is greedy. Penalties apply before temperature; then top-k, top-p and min-p filter.
- `repetition_penalty` follows Hugging Face (divides positive / multiplies negative logits of every token
  seen in the prompt or the output); `presence_penalty` / `frequency_penalty` follow OpenAI (subtract from
  logits of tokens already generated, once / per occurrence).
- `logprobs=k` returns, per generated token, the log-probabilities of the sampled token plus the top k,
  computed from the model's raw distribution (before penalties and temperature), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the model's context is full
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.n, int) or self.n < 1:
            _fail("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "values >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "values in (0, 1]")
        if self.top_k < -1:
            _fail("top_k", self.top_k, "-1 or 0 (disabled) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "values in [0, 1]")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "values > 0 (1 means no penalty)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _fail(name, getattr(self, name), "values in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "an integer >= 1")
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                _fail(name, value, f"an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            _fail("seed", self.seed, "an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            _fail("stop", self.stop, "non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "non-negative integers")

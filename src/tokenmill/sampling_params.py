"""How to pick tokens for one request. Mirrors vLLM's `SamplingParams`; every value is validated on creation.

Semantics:
- `temperature=0` is greedy. Penalties apply before temperature; then top-k, top-p and min-p filter.
- `repetition_penalty` follows Hugging Face (divides positive / multiplies negative logits of every token
  seen in the prompt or the output); `presence_penalty` / `frequency_penalty` follow OpenAI (subtract from
  logits of tokens already generated, once / per occurrence).
- `logprobs=k` returns, per generated token, the log-probabilities of the sampled token plus the top k,
  computed from the model's raw distribution (before penalties and temperature), as vLLM does.

`thinking` caps a reasoning model's thinking: after its budget of tokens, the end of thinking is forced
(`ThinkingBudget`).

`structured_outputs` constrains the output to a JSON schema, any JSON object, a regex, one of a list of strings,
or a grammar (Lark/EBNF or llama.cpp's GBNF), as vLLM's `StructuredOutputsParams` does (structured_output/).

Ranges (a value outside is a ValueError naming it): temperature >= 0 (below 1e-5: greedy), top_p in (0, 1],
top_k -1, 0 or 1..2^31-1, min_p in [0, 1], repetition_penalty > 0, presence/frequency_penalty in [-2, 2], every
float finite; seed a 64-bit integer; at most 16 stop strings; logprobs and prompt_logprobs in [0, 20].
"""

from __future__ import annotations

import json as _json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_TOP_K = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
INT64 = (-(2**63), 2**63 - 1)
# A temperature below this samples as greedy (vLLM's rule): dividing logits by ~1e-45 would turn them into NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings) or `grammar` (Lark/EBNF, or GBNF as llama.cpp writes it)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {named}")  # fmt: skip
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            _fail("choice", self.choice, "a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None

    def key(self) -> tuple[str, str]:
        """(kind, text): what a grammar backend compiles, and the compile cache's key."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json)  # key order is property order
            return "json", text
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar or "")


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `max_tokens` tokens of reasoning: once the thinking has taken that many, the tokens `end_token_ids`
    (a reasoning model's `</think>`) are forced, one a step, so that the answer comes. The thinking runs from the
    output's start where the prompt opened it (`opened`), else from the first `start_token_ids` the output
    writes, until `end_token_ids` follow. Not applied under `structured_outputs` (the grammar decides every token)."""

    max_tokens: int
    end_token_ids: tuple[int, ...]
    start_token_ids: tuple[int, ...] = ()
    opened: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            _fail("thinking_token_budget", self.max_tokens, "an integer >= 0")
        if not self.end_token_ids or (not self.opened and not self.start_token_ids):
            _fail("thinking", self, "end_token_ids, and start_token_ids unless the prompt opened the thinking")


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
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    thinking: ThinkingBudget | None = None  # a cap on a reasoning model's thinking

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_types()
        if not isinstance(self.n, int) or self.n < 1:
            _fail("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "values >= 0 (0 means greedy)")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        if not 0 < self.top_p <= 1 or _float32(self.top_p) == 0:  # 1e-46 is 0 in float32
            _fail("top_p", self.top_p, "values in (0, 1] that float32 does not round to 0")
        if not -1 <= self.top_k <= MAX_TOP_K:
            _fail("top_k", self.top_k, f"-1 or 0 (disabled) or an integer in [1, {MAX_TOP_K}]")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "values in [0, 1]")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "values > 0 (1 means no penalty)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _fail(name, getattr(self, name), "values in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an integer >= 1")
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                _fail(name, value, f"an integer in [0, {MAX_LOGPROBS}]")
        last_seed = INT64[1] - (self.n - 1)  # sample i of n uses seed + i
        if self.seed is not None and not INT64[0] <= self.seed <= last_seed:
            _fail("seed", self.seed, f"an integer in [{INT64[0]}, {last_seed}]")
        if any(not isinstance(s, str) or not s for s in self.stop) or len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", self.stop, f"at most {MAX_STOP_STRINGS} non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "non-negative integers")
        bias = self.logit_bias or {}
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in bias) or any(
            isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100 for v in bias.values()
        ):
            _fail("logit_bias", self.logit_bias, "token ids (integers >= 0) mapped to numbers in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")

    def _check_types(self) -> None:
        """Integers must be integers (not bools), floats finite numbers: NaN passes every comparison check."""
        ints = {"n": self.n, "top_k": self.top_k, "min_tokens": self.min_tokens, "max_tokens": self.max_tokens,
                "seed": self.seed, "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}  # fmt: skip
        for name, value in ints.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                _fail(name, value, "an integer")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "non-negative integers")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in floats:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                _fail(name, value, "a finite number")
            if abs(value) > FLOAT32_MAX:  # the sampler computes in float32: 1e39 would be inf there
                _fail(name, value, f"a number float32 holds (at most {FLOAT32_MAX:.6g} in size)")

"""A request's outputs sent between processes as what each adds (server/engine_process.py -> process_engine.py).

`RequestOutput` is cumulative: every output of a request carries all its text, tokens, logprobs and token times
so far. Sent whole at every step, a long generation would cost quadratic bytes; so the engine's side encodes what
each output adds (`OutputEncoder`), and the server's side adds it up again (`OutputDecoder`), giving outputs
equal to the engine's own. What was sent is normally kept and extended; where an output no longer starts with
it (never seen: a stop string cuts only what a step added), the part kept is sent with the rest.

Neither side knows the other's objects: an encoded output is plain tuples, lists, strings and numbers, with the
metrics dataclass and the pooled result. The prompt's tokens never travel back: the decoder has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from tokenmill.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput

_SCALARS = tuple(f.name for f in fields(RequestMetrics) if f.name != "token_times")


def _kept(sent: Any, now: Any) -> int:
    """How much of `sent` (a str or list) `now` still starts with."""
    if now[: len(sent)] == sent:
        return len(sent)
    same, most = 0, min(len(sent), len(now))
    while same < most and sent[same] == now[same]:
        same += 1
    return same


@dataclass
class _Sent:
    """What the decoder has of one completion."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None


class OutputEncoder:
    """The engine's side: one request's outputs, each as what it adds."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}
        self._times = 0  # token times sent
        self._prompt_logprobs_sent = False

    def encode(self, out: RequestOutput) -> tuple[Any, ...]:
        completions = [self._completion(c) for c in out.outputs]
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            prompt_logprobs, self._prompt_logprobs_sent = out.prompt_logprobs, True
        metrics = times = None
        if out.metrics is not None:
            all_times = out.metrics.token_times  # (the core's thread appends to it: read once)
            times, self._times = all_times[self._times : len(all_times)], len(all_times)
            metrics = replace(out.metrics, token_times=[])
        return (out.finished, out.error, out.pooled, out.new_text, prompt_logprobs, metrics, times, completions)

    def _completion(self, c: CompletionOutput) -> tuple[Any, ...]:
        sent = self._sent.setdefault(c.index, _Sent())
        text_kept, tokens_kept = _kept(sent.text, c.text), _kept(sent.token_ids, c.token_ids)
        lp_kept = 0 if c.logprobs is None or sent.logprobs is None else _kept(sent.logprobs, c.logprobs)
        logprobs = None if c.logprobs is None else c.logprobs[lp_kept:]
        sent.text, sent.token_ids, sent.logprobs = c.text, c.token_ids, c.logprobs
        return (c.index, text_kept, c.text[text_kept:], tokens_kept, c.token_ids[tokens_kept:], lp_kept, logprobs,
                c.cumulative_logprob, c.finish_reason, c.stop_reason)  # fmt: skip


class OutputDecoder:
    """The server's side: one request's outputs rebuilt from what each added."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self._have: dict[int, _Sent] = {}
        self._prompt_logprobs: list[Logprobs | None] | None = None
        self._metrics: RequestMetrics | None = None  # one object, updated in place as the engine's own is

    def decode(self, encoded: tuple[Any, ...]) -> RequestOutput:
        finished, error, pooled, new_text, prompt_logprobs, metrics, times, completions = encoded
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs
        if metrics is not None:
            if self._metrics is None:
                self._metrics = metrics
            else:
                for name in _SCALARS:
                    setattr(self._metrics, name, getattr(metrics, name))
            self._metrics.token_times.extend(times)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [self._completion(c) for c in completions], finished, self._prompt_logprobs,
                             self._metrics, new_text, error, pooled)  # fmt: skip

    def _completion(self, encoded: tuple[Any, ...]) -> CompletionOutput:
        index, text_kept, text, tokens_kept, tokens, lp_kept, logprobs, cumulative, finish, stop = encoded
        have = self._have.setdefault(index, _Sent())
        have.text = have.text[:text_kept] + text
        del have.token_ids[tokens_kept:]
        have.token_ids.extend(tokens)
        if logprobs is None:
            have.logprobs = None
        else:
            have.logprobs = have.logprobs if have.logprobs is not None else []
            del have.logprobs[lp_kept:]
            have.logprobs.extend(logprobs)
        return CompletionOutput(index, have.text, list(have.token_ids), cumulative,
                                None if have.logprobs is None else list(have.logprobs), finish, stop)  # fmt: skip

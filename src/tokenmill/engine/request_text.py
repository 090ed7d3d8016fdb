"""The server's side of the text, where the engine runs in its own process (process_engine.py).

There the engine makes outputs of tokens alone (`EngineCore(detokenize=False)`), and `RequestText` turns each into
the output the engine makes in one process (output_processor.py, with the same `SequenceText`): the text and its
streamed deltas, and stop strings. The first stop string a sample's text completes ends that sample there, as in
one process: its tokens, logprobs, cumulative logprob and counts are cut to the token that completed it, and its
finish_reason is "stop". The engine is told (`stop`) and ends the sample within a step; tokens it made past the
stop before it heard are never shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from tokenmill.engine.output_processor import SequenceText
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

Stop = Callable[[int, int, str], None]  # (sample index, output tokens kept, the stop string) -> tell the engine


class RequestText:
    """One request's text: its samples' `SequenceText`s, and where a stop string ended each."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams, stop: Stop) -> None:
        self.tokenizer, self.prompt_token_ids, self.params, self._stop = tokenizer, prompt_token_ids, params, stop
        self._texts: dict[int, SequenceText] = {}
        self._stopped: dict[int, tuple[int, str]] = {}  # sample index -> (output tokens kept, stop string)

    def apply(self, out: RequestOutput) -> RequestOutput:
        """`out` (tokens alone) with its text, deltas and stop strings, as the engine makes it in one process."""
        completions, deltas = [], []
        for c in out.outputs:
            text = self._texts.get(c.index)
            if text is None:
                text = self._texts[c.index] = SequenceText(self.tokenizer, self.prompt_token_ids, self.params)
            if c.index not in self._stopped:
                hit = self._detokenize(c, text)
                if hit is not None:
                    self._stopped[c.index] = hit
                    if not c.finished:  # (the engine ended it already: nothing to tell)
                        self._stop(c.index, *hit)
            stopped = self._stopped.get(c.index)
            c = c if stopped is None else _cut(c, *stopped)
            if c.finished:
                text.finish()
            completions.append(replace(c, text=text.text))
            deltas.append(text.take_delta(c.finished))
        finished = out.finished or (bool(completions) and all(c.finished for c in completions))
        metrics = out.metrics
        first = self._stopped.get(0)
        if metrics is not None and first is not None:  # the request's numbers are its first sample's
            metrics = replace(metrics, token_times=metrics.token_times[: first[0]], num_generated_tokens=first[0])
        if metrics is not None and finished and metrics.finished_time is None:
            metrics = replace(metrics, finished_time=time.perf_counter())
        return replace(out, outputs=completions, new_text=deltas, finished=finished, metrics=metrics)

    def _detokenize(self, c: CompletionOutput, text: SequenceText) -> tuple[int, str] | None:
        """The sample's new tokens into text (as `OutputProcessor.detokenize`): the first stop string they
        complete, as (output tokens to keep, stop), reading none past it."""
        new_ids = c.token_ids[text.num_tokens_seen :]
        min_tokens = self.params.min_tokens
        for i, tok in enumerate(new_ids):
            stop = text.add(tok, check_stops=text.num_tokens_seen + 1 > min_tokens)
            if stop is not None:
                return len(c.token_ids) - len(new_ids) + i + 1, stop
        if c.finished and new_ids:  # the held-back text ends with the last token, and may complete a string too
            stop = text.finish(check_stops=len(c.token_ids) > min_tokens)
            if stop is not None:
                return len(c.token_ids), stop
        return None


def _cut(c: CompletionOutput, keep: int, stop: str) -> CompletionOutput:
    """A sample ended by a stop string after its first `keep` tokens (as request_tokens.keep_tokens cuts one)."""
    logprobs = None if c.logprobs is None else c.logprobs[:keep]
    tokens = c.token_ids[:keep]
    cumulative = c.cumulative_logprob
    if logprobs is not None:
        cumulative = sum((lp[t] for lp, t in zip(logprobs, tokens, strict=True)), 0.0)
    return replace(c, token_ids=tokens, logprobs=logprobs, cumulative_logprob=cumulative, finish_reason="stop",
                   stop_reason=stop)  # fmt: skip

"""Output processing: token ids -> text, stop-string detection, and one `RequestOutput` per user request.

Pure reporting: it says "a stop string ends at output token k" and the engine core decides; it reads
requests and never writes them.

Text is produced incrementally (see `IncrementalDetokenizer`). When stop strings are set, the last
`len(longest stop) - 1` characters are held back from streaming deltas until they can no longer start a
stop string, so a client never sees part of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenmill.types import Request


class SequenceText:
    """The growing text of one sequence, with stop-string detection."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.num_tokens_seen = 0
        self.sent = 0  # characters of `text` already streamed
        self.done = False
        self.stopped = False  # a stop string cut the text: nothing more is added

    def add(self, token_id: int, check_stops: bool) -> str | None:
        """Append one token's text; return the stop string it completed, if any."""
        delta = self.detok.add(token_id)
        self.num_tokens_seen += 1
        return self._append(delta, check_stops)

    def finish(self, check_stops: bool = False) -> str | None:
        """The sequence ended: append what the detokenizer held back (an incomplete character, and the text
        before it in its window); return the stop string that text completes, if asked and any."""
        if self.done:
            return None
        self.done = True
        return self._append(self.detok.flush(), check_stops)

    def _append(self, delta: str, check_stops: bool) -> str | None:
        if not delta or self.stopped:
            return None
        search_from = max(len(self.text) - self.hold_back, 0)
        self.text += delta
        if not check_stops:
            return None
        found = [(idx, stop) for stop in self.stops if (idx := self.text.find(stop, search_from)) >= 0]
        if not found:
            return None
        idx, stop = min(found)  # the stop string that appears first in the text wins
        self.text = self.text[: idx + (len(stop) if self.include_stop else 0)]
        self.stopped = True
        return stop

    def take_delta(self, finished: bool) -> str:
        visible = len(self.text) if finished else max(len(self.text) - self.hold_back, self.sent)
        delta = self.text[self.sent : visible]
        self.sent = visible
        return delta


@dataclass(frozen=True)
class StopStringHit:
    num_tokens: int  # output tokens to keep: the one that completed the stop string is the last
    stop: str


@dataclass
class _Group:
    prompt: str | None
    children: list[Request]
    texts: list[SequenceText]


class OutputProcessor:
    """Detokenizes and reports; never changes a `Request`. The engine core decides what a stop string ends.

    Without a tokenizer it makes outputs of tokens alone (empty text) and finds no stop string: the engine's own
    process, whose server makes the text and stops at stop strings (engine/request_text.py)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}

    def add_request(self, prompt: str | None, children: list[Request]) -> None:
        tok = self.tokenizer
        texts = [] if tok is None else [SequenceText(tok, r.prompt_token_ids, r.params) for r in children]
        self._groups[children[0].parent_id] = _Group(prompt, children, texts)

    def detokenize(self, parent_id: str, index: int) -> StopStringHit | None:
        """Turn sample `index`'s new output tokens into text; report the first stop string they complete, and read
        none past it. It wins over whatever else ended the sequence at or after that token: the length limit on
        the same token, or a stop token, the length limit or a stop string later in a decode run's or kept drafts'
        tokens, which single steps would never have computed."""
        group = self._groups[parent_id]
        if not group.texts:
            return None
        req, text = group.children[index], group.texts[index]
        new_ids = req.output_token_ids[text.num_tokens_seen :]
        for i, tok in enumerate(new_ids):
            position = text.num_tokens_seen + 1  # 1-based count of output tokens incl. this one
            stop = text.add(tok, check_stops=position > req.params.min_tokens)
            if stop is not None:
                return StopStringHit(len(req.output_token_ids) - len(new_ids) + i + 1, stop)
        if req.finished and new_ids:  # the held-back text ends with the last token, and may complete a string too
            stop = text.finish(check_stops=len(req.output_token_ids) > req.params.min_tokens)
            if stop is not None:
                return StopStringHit(len(req.output_token_ids), stop)
        return None

    def make_outputs(self, parent_ids: list[str]) -> list[RequestOutput]:
        """One output per parent with the text so far; a finished parent is forgotten after its last output."""
        outputs = []
        for parent_id in parent_ids:
            group = self._groups[parent_id]
            for req, text in zip(group.children, group.texts):  # (none without a tokenizer)
                if req.finished:
                    text.finish()
            outputs.append(self._build(parent_id, group))
            if all(r.finished for r in group.children):
                del self._groups[parent_id]
        return outputs

    def _build(self, parent_id: str, group: _Group) -> RequestOutput:
        completions, deltas = [], []
        for i, req in enumerate(group.children):
            text = group.texts[i] if group.texts else None
            completions.append(
                CompletionOutput(
                    index=req.index,
                    text="" if text is None else text.text,
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                    logprobs=req.logprobs[: len(req.output_token_ids)] if req.logprobs is not None else None,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
            deltas.append("" if text is None else text.take_delta(req.finished))
        first = group.children[0]
        return RequestOutput(
            request_id=parent_id,
            prompt=group.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=all(r.finished for r in group.children),
            prompt_logprobs=first.prompt_logprobs,
            metrics=first.metrics,
            new_text=deltas,
        )

    def abort(self, parent_id: str) -> RequestOutput | None:
        """Forget an aborted request; return its final output (None if unknown)."""
        group = self._groups.pop(parent_id, None)
        if group is None:
            return None
        for text in group.texts:
            text.finish()
        return self._build(parent_id, group)

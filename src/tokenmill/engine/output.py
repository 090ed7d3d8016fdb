"""Output processing: token ids -> text, stop strings, and one `RequestOutput` per user request.

Text is produced incrementally (see `IncrementalDetokenizer`). When stop strings are set, the last
`len(longest stop) - 1` characters are held back from streaming deltas until they can no longer start a
stop string, so a client never sees part of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenmill.types import Request, RequestStatus


class SequenceText:
    """The growing text of one sequence, with stop-string detection."""

    def __init__(self, tokenizer: Tokenizer, req: Request) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
        self.stops = req.params.stop
        self.include_stop = req.params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.num_tokens_seen = 0
        self.sent = 0  # characters of `text` already streamed
        self.done = False

    def add(self, token_id: int, check_stops: bool) -> str | None:
        """Append one token's text; return the stop string it completed, if any."""
        delta = self.detok.add(token_id)
        self.num_tokens_seen += 1
        return self._append(delta, check_stops)

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self._append(self.detok.flush(), check_stops=False)

    def _append(self, delta: str, check_stops: bool) -> str | None:
        if not delta:
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
        return stop

    def take_delta(self, finished: bool) -> str:
        visible = len(self.text) if finished else max(len(self.text) - self.hold_back, self.sent)
        delta = self.text[self.sent : visible]
        self.sent = visible
        return delta


@dataclass
class _Group:
    prompt: str | None
    children: list[Request]
    texts: list[SequenceText | None]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}

    def add_request(self, prompt: str | None, children: list[Request]) -> None:
        tok = self.tokenizer
        texts = [SequenceText(tok, r) if tok is not None else None for r in children]
        self._groups[children[0].parent_id] = _Group(prompt, children, texts)

    def process(self, updated_parents: list[str]) -> list[RequestOutput]:
        """Detokenize new tokens of the given requests, finish any that hit a stop string, build outputs."""
        outputs = []
        for parent_id in updated_parents:
            group = self._groups[parent_id]
            for req, text in zip(group.children, group.texts):
                if text is None:
                    continue
                new_ids = req.output_token_ids[text.num_tokens_seen :]
                for i, tok in enumerate(new_ids):
                    position = text.num_tokens_seen + 1  # 1-based count of output tokens incl. this one
                    stop = text.add(tok, check_stops=position > req.params.min_tokens)
                    if stop is not None and not req.finished:
                        # drop tokens generated after the one that completed the stop string
                        del req.output_token_ids[len(req.output_token_ids) - len(new_ids) + i + 1 :]
                        req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, "stop", stop
                        break
                if req.finished:
                    text.finish()
            outputs.append(self._build(parent_id, group))
            if all(r.finished for r in group.children):
                del self._groups[parent_id]
        return outputs

    def _build(self, parent_id: str, group: _Group) -> RequestOutput:
        completions, deltas = [], []
        for req, text in zip(group.children, group.texts):
            completions.append(
                CompletionOutput(
                    index=req.index,
                    text=text.text if text else "",
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                    logprobs=req.logprobs[: len(req.output_token_ids)] if req.logprobs is not None else None,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
            deltas.append(text.take_delta(req.finished) if text else "")
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
            if text is not None:
                text.finish()
        return self._build(parent_id, group)

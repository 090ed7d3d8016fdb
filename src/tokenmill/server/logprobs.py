"""Logprobs as the OpenAI API writes them: completions' (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`), chat's (`content` items with `bytes`), and vLLM's `prompt_logprobs`.

Must not import torch.
"""

from __future__ import annotations

from typing import Any

from tokenmill.outputs import Logprobs
from tokenmill.tokenizer import Tokenizer


def _token_str(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


LOGPROB_FLOOR = -9999.0  # vLLM's: JSON has no -inf (a logit the model set to -inf) and no NaN (a broken model's)


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the comparison too


def completion_logprobs(tok: Tokenizer, token_ids: list[int], entries: list[Logprobs | None], top: int,
                        offset: int = 0) -> tuple[dict[str, Any], int]:  # fmt: skip
    """Completions' logprobs of these tokens, each with its `top` likeliest alternatives (an echoed prompt's entries
    may hold more: `prompt_logprobs`), their `text_offset` going on from `offset`; and the offset after them (a
    stream's next chunk starts there)."""
    tokens, values, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = _token_str(tok, tid)
        tokens.append(text)
        values.append(_finite(entry[tid]) if entry else None)
        tops.append(_top_by_text(tok, entry, top, tid) if entry else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def _top_by_text(tok: Tokenizer, entry: Logprobs, top: int, chosen: int) -> dict[str, float]:
    """{token text: logprob} of the `top` likeliest and the chosen token, most likely first. Tokens that decode
    alike (parts of characters all read U+FFFD) share a key: it keeps the likeliest one's value."""
    tops: dict[str, float] = {}
    for rank, (t, lp) in enumerate(sorted(entry.items(), key=lambda kv: -_finite(kv[1]))):
        if rank < top or t == chosen:
            tops.setdefault(_token_str(tok, t), _finite(lp))
    return tops


def chat_logprobs(tok: Tokenizer, token_ids: list[int], entries: list[Logprobs], top: int) -> dict[str, Any]:
    def item(t: int, lp: float) -> dict[str, Any]:  # bytes: the token's own, where its text is part of a character
        return {"token": _token_str(tok, t), "logprob": _finite(lp), "bytes": list(tok.token_bytes(t))}

    content = []
    for tid, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda kv: -_finite(kv[1]))[:top]
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in ranked]})
    return {"content": content}


def prompt_logprobs(tok: Tokenizer, entries: list[Logprobs | None], top: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none: null), token id -> `{"logprob", "rank",
    "decoded_token"}` for the prompt's token and the top `top`. `rank` counts from 1 among the top k; the prompt's
    token outside them has `rank` null (tokenmill does not rank the whole vocabulary)."""
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -_finite(kv[1]))
        out.append({str(t): {"logprob": _finite(lp), "rank": r + 1 if r < top else None,
                             "decoded_token": _token_str(tok, t)} for r, (t, lp) in enumerate(ranked)})  # fmt: skip
    return out

"""What a proposer is asked, per sequence, and the interface both proposers share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    token_ids: list[int]  # the sequence so far: prompt and output
    limit: int  # the most drafts it can use (its max_tokens and the context)


class Proposer(Protocol):
    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """Drafts to follow each sequence (possibly none)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished sequence."""
        ...

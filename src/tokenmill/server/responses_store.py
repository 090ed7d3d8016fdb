"""The Responses API's store: responses created with `store: true`, kept in memory for `GET /v1/responses/{id}`,
`input_items` and `previous_response_id`, at most `--responses-store-size` of them; the least recently used (made,
read or continued) goes first when a new one needs room.

Each response keeps its own items only (its input, then its output) and the id of the response it continued, so a
long conversation costs its length once, not once per turn. Continuing one walks that chain back: when any
response in it has been dropped or deleted, the conversation is gone (404), not silently shortened.

Used from the event loop only (no lock).

Must not import torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenmill.server.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it was answered
    input_items: list[dict[str, Any]]  # this request's input items (normalized, with ids)
    previous_id: str | None  # the response this one continued


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # responses kept (0: none); launch.py checks it is >= 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._responses[stored.body["id"]] = stored
        self._responses.move_to_end(stored.body["id"])
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response (now the most recently used); 404 when it is not stored."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found: it was not stored (store=false), was "
                           "deleted, or was dropped from the store (--responses-store-size)", param=param)  # fmt: skip
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._responses[response_id]

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """Every item of the conversation that `response_id` ended, oldest first: each response's input, then its
        output, back along the chain. Empty for None; 404 when any response in the chain is gone."""
        chain: list[StoredResponse] = []
        seen: set[str] = set()
        while response_id is not None and response_id not in seen:
            seen.add(response_id)
            stored = self.get(response_id, param="previous_response_id")
            chain.append(stored)
            response_id = stored.previous_id
        items: list[dict[str, Any]] = []
        for stored in reversed(chain):
            items += stored.input_items + stored.body["output"]
        return items

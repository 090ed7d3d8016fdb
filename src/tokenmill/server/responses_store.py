"""The Responses API's store: responses created with `store: true`, kept in memory for `GET /v1/responses/{id}`,
`input_items` and `previous_response_id`, at most `--responses-store-size` of them; the least recently used (made,
read or continued) goes first when a new one needs room.

Each response keeps its own items only (its input, then its output) and the id of the response it continued, so a
long conversation costs its length once, not once per turn. Continuing one walks that chain back: when any
response in it has been dropped or deleted, the conversation is gone (404), not silently shortened; when one is
a background response still running, it is not finished yet (400).

A background response is stored from the start, with its run (responses_background.py), which writes its progress
with `update`. It counts against the capacity like any other, and a run whose response is dropped or deleted is
stopped: its engine request is aborted.

Used from the event loop only (no lock).

Must not import torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.server.errors import APIError
from tokenmill.server.responses_background import BackgroundRun

RUNNING = ("queued", "in_progress")  # a background response's statuses before it ends


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it was answered
    input_items: list[dict[str, Any]]  # this request's input items (normalized, with ids)
    previous_id: str | None  # the response this one continued
    run: BackgroundRun | None = None  # a background response's generation


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
            _drop(self._responses.popitem(last=False)[1])

    def update(self, response_id: str, body: dict[str, Any]) -> None:
        """A background response's current object; a no-op once the response is gone. Not a use: the order stays."""
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses[response_id] = replace(stored, body=body)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response (now the most recently used); 404 when it is not stored."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found: it was not stored (store=false), was "
                           "deleted, or was dropped from the store (--responses-store-size)", param=param)  # fmt: skip
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        _drop(self.get(response_id))
        del self._responses[response_id]

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """Every item of the conversation that `response_id` ended, oldest first: each response's input, then its
        output, back along the chain. Empty for None; 404 when any response in the chain is gone."""
        chain: list[StoredResponse] = []
        seen: set[str] = set()
        while response_id is not None and response_id not in seen:
            seen.add(response_id)
            stored = self.get(response_id, param="previous_response_id")
            if stored.body["status"] in RUNNING:
                raise APIError(400, f"Response '{response_id}' is still running in the background: wait until its "
                               "status is no longer queued or in_progress", param="previous_response_id")  # fmt: skip
            chain.append(stored)
            response_id = stored.previous_id
        items: list[dict[str, Any]] = []
        for stored in reversed(chain):
            items += stored.input_items + stored.body["output"]
        return items


def _drop(stored: StoredResponse) -> None:
    if stored.run is not None:
        stored.run.stop()

"""The LoRA adapters an engine serves, by name: owned by the engine core (changed on its loop thread only, between
steps), their matrices installed in the runner's model (models/lora.py).

Each loaded adapter gets an id never used before (a request's `lora_id`; 0 is the base model), so a request can
never run with an adapter loaded later under the same name. `loaded` is a tuple replaced whole on each change, so
other threads read it without a lock. Unloading an adapter that running or waiting requests use is refused (409):
the caller retries once they finish.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import count

from tokenmill.engine.validation import check_adapter
from tokenmill.errors import LoraError
from tokenmill.models.lora import Adapter, ModelLoras
from tokenmill.runner import ModelRunner
from tokenmill.weights.lora_files import read_adapter


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    adapter_id: int
    path: str
    rank: int
    digest: int  # the prefix cache's salt for its requests


class LoraRegistry:
    def __init__(self, runner: ModelRunner, loras: ModelLoras, max_rank: int) -> None:
        self.runner, self.max_rank = runner, max_rank
        self._shapes = loras.shapes()  # fixed at construction: any thread may read adapters against them
        self._by_name: dict[str, LoadedAdapter] = {}
        self._users: dict[int, set[str]] = {}  # adapter id -> the unfinished sequences (request ids) that run with it
        self._ids = count(1)
        self.loaded: tuple[LoadedAdapter, ...] = ()  # replaced whole on each change: other threads read it as it is
        self.busy: frozenset[int] = frozenset()  # ids of adapters unfinished sequences use (replaced whole, too)

    def read(self, name: str, path: str) -> Adapter:
        """The adapter in `path`, checked against the model (LoraError 400 if it does not fit). Any thread."""
        self._check_new(name)
        try:
            return read_adapter(name, path, self._shapes, self.max_rank)
        except ValueError as e:
            raise LoraError(str(e)) from None

    def add(self, adapter: Adapter) -> LoadedAdapter:
        """Install a read adapter under its name (loop thread)."""
        self._check_new(adapter.name)
        loaded = LoadedAdapter(adapter.name, next(self._ids), adapter.path, adapter.rank, adapter.digest)
        self.runner.install_lora(loaded.adapter_id, adapter)
        self._by_name[adapter.name] = loaded
        self.loaded = tuple(self._by_name.values())
        return loaded

    def check_unload(self, name: str) -> None:
        """LoraError 404 / 409 where `name` cannot be unloaded now (from the published tuples: any thread; the loop
        checks again when it unloads)."""
        self.check(name)
        adapter = next(a for a in self.loaded if a.name == name)
        if adapter.adapter_id in self.busy:
            raise LoraError(f"LoRA adapter {name!r} is in use by unfinished requests; unload it once they finish",
                            status=409)  # fmt: skip

    def remove(self, name: str) -> None:
        """Unload `name` (loop thread); refused while a sequence runs with it."""
        loaded = self.get(name)
        users = self._users.get(loaded.adapter_id)
        if users:
            raise LoraError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s); unload it once "
                            "they finish", status=409)  # fmt: skip
        self._users.pop(loaded.adapter_id, None)
        self.runner.remove_lora(loaded.adapter_id)
        del self._by_name[name]
        self.loaded = tuple(self._by_name.values())

    def get(self, name: str) -> LoadedAdapter:
        loaded = self._by_name.get(name)
        if loaded is None:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded; loaded: {_listing(self.names)}", status=404)
        return loaded

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.loaded)

    def check(self, name: str) -> None:
        """LoraError 404, naming the loaded adapters, unless `name` is one (from the published tuple: any thread)."""
        check_adapter(name, self.names)

    def take(self, name: str, request_ids: Iterable[str]) -> LoadedAdapter:
        """The adapter new sequences run with; it is in use until each is released (loop thread)."""
        loaded = self.get(name)
        self._users.setdefault(loaded.adapter_id, set()).update(request_ids)
        self._publish_busy()
        return loaded

    def release(self, adapter_id: int, request_id: str) -> None:
        """A sequence that ran with the adapter ended (finished, aborted or failed)."""
        users = self._users.get(adapter_id)
        if users is not None:
            users.discard(request_id)
            if not users:
                self._publish_busy()

    def _publish_busy(self) -> None:
        self.busy = frozenset(i for i, users in self._users.items() if users)

    def _check_new(self, name: str) -> None:
        if not name or not name.strip():
            raise LoraError("a LoRA adapter needs a non-empty name")
        if name in self._by_name:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded (from {self._by_name[name].path}); "
                            "unload it first or pick another name")  # fmt: skip


def _listing(names: Iterable[str]) -> str:
    return ", ".join(names) or "none"

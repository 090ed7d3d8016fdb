"""Data parallel on Ray: N engine replicas as Ray actors behind one OpenAI front end.

`tokenmill serve --data-parallel-size N` (extra `tokenmill[ray]`) starts N `Replica` actors, each a whole
`AsyncEngine` in its own process (on this machine with a fresh local Ray, or on a cluster with
`--ray-address`). Ray actors rather than a Ray Serve deployment: the front end is our own FastAPI app, and
routing needs what Serve's router does not know, each replica's load and prompt prefixes.

`RayEngine` stands where the server expects an `AsyncEngine`. Per prompt it picks a replica (`Router`):
the one that last served the prompt's longest known prefix (its prefix cache holds those blocks, as SGLang's
router reasons), unless that one has `SLACK` more sequences in flight than the least loaded; else the least
loaded. Outputs stream back through a Ray streaming generator; closing the stream (a finished or
disconnected client) aborts the request on its replica. A replica that dies is restarted by `RayEngine`'s
watch thread (ray_engine.py: a backoff and a limit); while it is down the router sends nothing there. A
request whose replica died before it produced anything is sent to another replica; one that had started gets a
clean error. `/metrics` shows each replica's engine numbers with a `replica` label.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.request_stream import RequestFailedError
from tokenmill.metrics import EngineSnapshot
from tokenmill.outputs import RequestOutput
from tokenmill.types import EngineRequest

log = logging.getLogger("tokenmill.parallel")
PREFIXES = (1024, 512, 256, 128, 64, 32, 16)  # prompt prefix lengths (tokens) the router remembers
SLACK = 4  # sequences in flight a prefix's replica may have above the least loaded one and still get it
MAX_PREFIXES = 65536
NICE = 5


class Replica:
    """One engine replica (the body of a Ray actor): an AsyncEngine driven from the actor's event loop."""

    def __init__(self, cfg: EngineConfig) -> None:
        import os

        import torch

        from tokenmill.engine.async_engine import AsyncEngine

        torch.set_num_threads(cfg.threads or 1)
        # below Ray's own processes: on a machine with no spare core, a starved GCS makes Ray end the driver
        os.nice(NICE)
        self.pid = os.getpid()
        self.engine = AsyncEngine.from_config(cfg)

    def info(self) -> dict[str, Any]:
        core = self.engine.core
        return {"pid": self.pid, "max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "num_blocks": core.kv.num_blocks, "block_size": core.kv.block_size,
                "description": self.engine.description}  # fmt: skip

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        stream = self.engine.add_requests([request.prompt_token_ids], request.params, [request.request_id],
                                          request.priority)[0]  # fmt: skip
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()  # a cancelled generator (the client left) aborts the request

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def healthy(self) -> bool:
        return self.engine.is_healthy


class Router:
    """Which replica a prompt goes to: its prefix's replica unless overloaded, else the least loaded."""

    def __init__(self, n: int) -> None:
        self.load = [0] * n  # sequences in flight, per replica
        self.up = [True] * n
        self._owner: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def pick(self, prompt: list[int], n: int = 1, avoid: int | None = None) -> int:
        alive = [i for i, up in enumerate(self.up) if up and i != avoid] or [i for i, up in enumerate(self.up) if up]
        if not alive:
            raise RequestFailedError("no engine replica is running")
        least = min(alive, key=lambda i: self.load[i])
        keys = [tuple(prompt[:k]) for k in PREFIXES if len(prompt) >= k]
        owner = next((self._owner[k] for k in keys if k in self._owner), None)
        chosen = owner if owner in alive and self.load[owner] <= self.load[least] + SLACK else least
        for k in keys:
            self._owner[k] = chosen
            self._owner.move_to_end(k)
        while len(self._owner) > MAX_PREFIXES:
            self._owner.popitem(last=False)
        self.load[chosen] += n
        return chosen

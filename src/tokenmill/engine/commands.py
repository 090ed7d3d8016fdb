"""What the server's threads ask of `AsyncEngine`'s loop thread (engine/async_engine.py): commands it applies
between steps, in the order posted."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.types import EngineRequest


@dataclass
class Add:
    request: EngineRequest


@dataclass
class Abort:
    request_id: str


class AbortAll:
    pass


@dataclass
class StopSequence:
    parent_id: str
    index: int
    num_tokens: int
    stop: str


@dataclass
class Call:
    """Run `fn` on the loop thread between steps (a LoRA adapter's load or unload); its result goes to `done`."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future[Any]


class Stop:
    pass


Command = Add | Abort | AbortAll | Stop | Call | StopSequence

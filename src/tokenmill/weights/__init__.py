"""Finding checkpoints and streaming their tensors into our model classes.

The names load on first use: the loader pulls in torch, and a server's front end (engine/process_engine.py) reads
only `source`, so that it starts beside the engine's process instead of after torch's import."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.weights.loader import load_weights
    from tokenmill.weights.source import resolve_model

__all__ = ["load_weights", "resolve_model"]


def __getattr__(name: str) -> Any:
    if name == "load_weights":
        from tokenmill.weights.loader import load_weights

        return load_weights
    if name == "resolve_model":
        from tokenmill.weights.source import resolve_model

        return resolve_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

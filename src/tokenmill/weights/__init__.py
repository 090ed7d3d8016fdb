"""Finding checkpoints and streaming their tensors into our model classes."""

from tokenmill.weights.loader import load_weights
from tokenmill.weights.source import resolve_model

__all__ = ["load_weights", "resolve_model"]

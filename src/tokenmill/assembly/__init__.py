"""From a model reference to running parts: the loaded model (model.py) and, wired to it, the KV backend, the KV
manager and the runner (parts.py). The engine, the draft model, tensor-parallel workers and Ray replicas' validation
all build through here."""

from tokenmill.assembly.model import LoadedModel, load, load_front
from tokenmill.assembly.parts import Parts, build_parts, kv_manager

__all__ = ["LoadedModel", "Parts", "build_parts", "kv_manager", "load", "load_front"]

"""What an engine holds in memory: its weights and KV pool, counted when it starts (its log line, and a server's
memory budget: `AsyncEngine.memory_bytes`), and given back when it is gone (`return_memory`).

No torch at import: the server's door (async_engine.py) imports this.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from tokenmill.memory import trim

if TYPE_CHECKING:
    from tokenmill.assembly.model import LoadedModel
    from tokenmill.engine.core import EngineCore


def model_bytes(model: LoadedModel, core: EngineCore) -> tuple[int, int]:
    """(weight bytes, KV pool bytes) at start: every weight the model holds (a mixture of experts' every expert, not
    the share a token reads), and the pool as reserved (a CPU pool's pages fill in as its blocks are first used)."""
    from torch import nn

    from tokenmill.attention import PagedKVCache
    from tokenmill.models.linear import weight_bytes

    emb = model.model.embeddings()
    embedding = emb.weight if isinstance(emb, nn.Embedding) else emb.data  # a table, or a PackedEmbedding's panels
    head = model.model.lm_head
    tied = getattr(head, "weight", getattr(head, "data", None)) is embedding  # weight_bytes counted it as the head
    weights = weight_bytes(model.model, active=False) + (0 if tied else embedding.nbytes)
    pool = getattr(core.runner, "kv", None)
    return weights, pool.nbytes if isinstance(pool, PagedKVCache) else 0


def memory_line(weights: int, kv: int) -> str:
    """Where the memory goes at start: the weights, the KV pool and the process's resident set."""
    import psutil

    mb = 2**20
    return (f"memory: weights {round(weights / mb)} MiB, KV pool {round(kv / mb)} MiB reserved, "
            f"process RSS {round(psutil.Process().memory_info().rss / mb)} MiB")  # fmt: skip


def return_memory() -> None:
    """Once an engine has shut down and its last reference is gone: collect it, hand the allocator's freed pages
    back to the system (memory.trim), and on a GPU torch's cached blocks back to the device."""
    import gc

    gc.collect()
    trim()
    torch = sys.modules.get("torch")  # (only where an engine imported it)
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

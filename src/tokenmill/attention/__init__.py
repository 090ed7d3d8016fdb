"""Attention over the KV cache for a flattened batch of sequences (prefills, prefill chunks and decodes)."""

from tokenmill.attention.backend import AttentionMetadata, KVStore, attend

__all__ = ["AttentionMetadata", "KVStore", "attend"]

"""Chained block hashes for prefix caching.

A full block's hash covers its parent block's hash and its own token ids, so two blocks with equal hashes hold
KV for equal whole prefixes (up to a 128-bit collision). The hash is stable across processes and runs: it is
built with `hashlib`, never with Python's salted `hash()`.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

# NOTE: 16 bytes (128 bits) keeps accidental collisions out of reach for any realistic cache size; a collision
# would silently hand a request another prefix's KV.
_DIGEST_SIZE = 16


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash one block's token ids chained on its parent block's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    # NOTE: the parent is written as its decimal text then a separator that no digit can be, and the tokens as
    # fixed-width int64, so no (parent, tokens) pair can encode to the same bytes as another.
    h.update(b"-" if parent_hash is None else str(parent_hash).encode())
    h.update(b"|")
    tokens = array("q", token_ids)
    if sys.byteorder != "little":  # same bytes, hence same hash, on every machine
        tokens.byteswap()
    h.update(tokens.tobytes())
    return int.from_bytes(h.digest(), "little")

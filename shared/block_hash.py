"""Chained block hashes: the scheduler's prefix cache and the gateway router must agree on these.

A block's hash covers its parent's hash, so equal hashes mean equal whole prefixes, not just
equal blocks. sha256 (not Python's `hash`) keeps values stable across processes and versions.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: bytes = b"") -> int:
    """64-bit hash of one full block of tokens chained to its parent block's hash."""
    digest = hashlib.sha256()
    digest.update(struct.pack("<Q", parent_hash))
    digest.update(salt)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest()[:8], "little")


def hash_full_blocks(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[int]:
    """Hashes of every full block of `token_ids`, in order; a partial tail block has none."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes

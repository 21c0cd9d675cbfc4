"""One KV block as a tier stores it: its key, and its value with a checksum.

The key names everything that makes two blocks' bytes interchangeable: the model artifact's
digest, the KV element type, the block size and the chained block hash (which carries the
tenant's salt, so one tenant's block is never another's). The value holds the block's token
ids (re-checked on load, as the pool re-checks a hash hit) and its K and V for every layer,
contiguous, under a CRC-32 of both: a flipped byte is a failed load, never a wrong token.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sIIQ")  # magic, crc32, num_tokens, payload bytes


class BadBlock(Exception):
    """A stored block that cannot be used: its reason is a metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TierNamespace:
    """The key prefix of one model, KV dtype and block size; blocks of any other never match."""

    model_digest: str
    kv_dtype: str
    block_size: int

    @property
    def prefix(self) -> str:
        return f"kvmesh:kv:{self.model_digest[:16]}:{self.kv_dtype}:{self.block_size}"

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}:{block_hash:016x}"


def pack(token_ids: Sequence[int], payload: bytes | memoryview) -> bytes:
    tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    checksum = zlib.crc32(payload, zlib.crc32(tokens))
    header = _HEADER.pack(MAGIC, checksum, len(token_ids), len(payload))
    return b"".join((header, tokens, payload))


def unpack(value: bytes, token_ids: Sequence[int], payload_bytes: int) -> memoryview:
    """The block's K/V bytes, if `value` is whole, for these tokens and this pool's layout."""
    if len(value) < _HEADER.size:
        raise BadBlock("truncated")
    magic, checksum, num_tokens, size = _HEADER.unpack_from(value)
    body = memoryview(value)[_HEADER.size :]
    if magic != MAGIC or size != payload_bytes or len(body) != 4 * num_tokens + size:
        raise BadBlock("layout")
    tokens, payload = body[: 4 * num_tokens], body[4 * num_tokens :]
    if zlib.crc32(payload, zlib.crc32(tokens)) != checksum:
        raise BadBlock("checksum")
    if tuple(struct.unpack(f"<{num_tokens}I", tokens)) != tuple(token_ids):
        raise BadBlock("tokens")  # a 64-bit hash collision: recompute instead
    return payload

"""Which block hashes became findable in the prefix cache, or stopped being so, since the last
drain: what the scheduler publishes to Redis for the gateway's cache-aware routing.

Only the newest state of each (salt, hash) is kept, so a block stored and evicted between two
drains costs nothing to publish. Bounded: past `limit` entries the log drops them and asks for
a resync (the whole cache republished) instead of growing while Redis is away.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheDelta:
    """Hashes to add to and remove from each salt's set."""

    stored: dict[bytes, list[int]] = field(default_factory=dict)
    evicted: dict[bytes, list[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(map(len, self.stored.values())) + sum(map(len, self.evicted.values()))


class CacheEventLog:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._latest: dict[tuple[bytes, int], bool] = {}  # (salt, hash) -> findable now
        self.needs_resync = True  # nothing published yet: start from a clean slate

    def stored(self, salt: bytes, block_hash: int) -> None:
        self._record(salt, block_hash, True)

    def evicted(self, salt: bytes, block_hash: int) -> None:
        self._record(salt, block_hash, False)

    def _record(self, salt: bytes, block_hash: int, findable: bool) -> None:
        if self.needs_resync:
            return  # the resync reads the cache itself
        self._latest[(salt, block_hash)] = findable
        if len(self._latest) > self.limit:
            self.request_resync()

    def request_resync(self) -> None:
        self._latest.clear()
        self.needs_resync = True

    def drain(self) -> CacheDelta:
        delta = CacheDelta()
        for (salt, block_hash), findable in self._latest.items():
            target = delta.stored if findable else delta.evicted
            target.setdefault(salt, []).append(block_hash)
        self._latest.clear()
        return delta

"""`KVBlockStore`: the tiers under a worker's pool, looked up, loaded from and written to.

Lookups and loads walk the tiers fastest first (host, disk, Redis) and ask Redis once per
call, in one round trip, for whatever the local tiers lack. Writes never wait: the step offers
a block's bytes to a bounded queue and a writer thread checksums it and puts it in every tier;
a full queue drops the write and counts it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from services.engine_worker.kv_tiers.block_record import BadBlock, TierNamespace, pack, unpack
from services.engine_worker.kv_tiers.local_tiers import DiskTier, HostTier
from services.engine_worker.kv_tiers.prefetch import Prefetcher
from services.engine_worker.kv_tiers.redis_tier import RedisTier, RedisTierDown
from services.engine_worker.kv_tiers.tier_metrics import TierStats
from shared.config import KVTierConfig

log = logging.getLogger("kvmesh.kv_tiers")


class LocalTier(Protocol):
    name: str

    def contains(self, key: str) -> bool: ...
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes) -> None: ...


class KVBlockStore:
    def __init__(self, config: KVTierConfig, namespace: TierNamespace) -> None:
        self.config = config
        self.namespace = namespace
        self.stats = TierStats()
        self.local: list[LocalTier] = []
        if "host" in config.tiers:
            self.local.append(HostTier(config.host_bytes))
        if "disk" in config.tiers:
            self.local.append(DiskTier(config.disk_dir, config.disk_bytes))
        self.remote = (
            RedisTier(config.redis_url, config.redis_bytes) if "redis" in config.tiers else None
        )
        self.prefetcher = Prefetcher(self.remote) if self.remote is not None else None
        self._writes: queue.Queue[tuple[str, Sequence[int], bytes | memoryview]] = queue.Queue(
            config.write_queue_blocks
        )
        self._writer = threading.Thread(target=self._write_forever, name="kv-writer", daemon=True)
        self._writer.start()

    def leading(self, block_hashes: Sequence[int]) -> int:
        """How many of these blocks, from the first, some tier holds."""
        return len(self.leading_tiers(block_hashes))

    def leading_tiers(self, block_hashes: Sequence[int]) -> list[str]:
        """For each of these blocks from the first, the fastest tier that holds it, up to the
        first that none holds."""
        keys = [self.namespace.key(h) for h in block_hashes]
        held = [next((t.name for t in self.local if t.contains(key)), "") for key in keys]
        if self.remote is not None and not all(held):
            missing = [i for i, tier in enumerate(held) if not tier]
            try:
                answers = self.remote.contains_many([keys[i] for i in missing])
            except RedisTierDown:
                answers = [False] * len(missing)
            for index, found in zip(missing, answers, strict=True):
                held[index] = "redis" if found else ""
        return held[: next((i for i, tier in enumerate(held) if not tier), len(held))]

    def prefetch(self, block_hashes: Sequence[int]) -> None:
        """Starts fetching these blocks from Redis into host memory (off every step)."""
        if self.prefetcher is not None:
            self.prefetcher.start([self.namespace.key(h) for h in block_hashes])

    def block_load_seconds(self, tier: str) -> float | None:
        """What loading one block from `tier` has taken on average; None before any did."""
        hits = self.stats.hits[tier]
        return self.stats.load_seconds.get(tier, 0.0) / hits if hits else None

    def load(
        self, block_hashes: Sequence[int], token_ids: Sequence[Sequence[int]], payload_bytes: int
    ) -> tuple[list[memoryview], str | None]:
        """Each block's K/V bytes from the first on, up to the first that no tier holds whole;
        and why it stopped there (None when every block loaded)."""
        keys = [self.namespace.key(h) for h in block_hashes]
        found: list[tuple[str, bytes | None]] = []
        for key in keys:
            found.append(self._local_get(key))
        if self.remote is not None and any(value is None for _, value in found):
            found = self._remote_fill(self.remote, keys, found)
        payloads: list[memoryview] = []
        for (tier, value), tokens in zip(found, token_ids, strict=True):
            if value is None:
                if tier != "failed":
                    self.stats.missed(tier)
                return payloads, "missing" if tier != "failed" else "unavailable"
            try:
                payloads.append(unpack(value, tokens, payload_bytes))
            except BadBlock as bad:
                self.stats.load_failed(tier, bad.reason)
                return payloads, bad.reason
        return payloads, None

    def _local_get(self, key: str) -> tuple[str, bytes | None]:
        """A block staged by a prefetch, else from the fastest local tier that has it."""
        if self.prefetcher is not None and (staged := self.prefetcher.take(key)) is not None:
            self.stats.loaded("redis", len(staged[0]), staged[1])
            return "redis", staged[0]
        for tier in self.local:
            started = time.perf_counter()
            value = tier.get(key)
            if value is not None:
                self.stats.loaded(tier.name, len(value), time.perf_counter() - started)
                return tier.name, value
        return (self.local[-1].name if self.local else "none"), None

    def _remote_fill(
        self, remote: RedisTier, keys: list[str], found: list[tuple[str, bytes | None]]
    ) -> list[tuple[str, bytes | None]]:
        """Redis's values, in one round trip, for the blocks no local tier had, from the
        first such block on (the load stops there anyway if Redis lacks it too)."""
        first = next(i for i, (_, value) in enumerate(found) if value is None)
        wanted = [i for i in range(first, len(keys)) if found[i][1] is None]
        started = time.perf_counter()
        try:
            values = remote.get_many([keys[i] for i in wanted])
        except RedisTierDown as down:
            self.stats.load_failed("redis", "unavailable")
            log.warning("kv tier load failed", extra={"tier": "redis", "error": str(down)})
            return [*found[:first], ("failed", None)]
        seconds = (time.perf_counter() - started) / max(1, sum(v is not None for v in values))
        merged = list(found)
        for index, value in zip(wanted, values, strict=True):
            merged[index] = ("redis", value)
            if value is not None:
                self.stats.loaded("redis", len(value), seconds)
        return merged

    def offer(self, block_hash: int, token_ids: Sequence[int], payload: bytes | memoryview) -> bool:
        """Queues one block for every tier (`payload` is the caller's no more); False
        (counted) when the queue is full."""
        try:
            self._writes.put_nowait((self.namespace.key(block_hash), token_ids, payload))
            return True
        except queue.Full:
            self.stats.dropped()
            return False

    def flush(self) -> None:
        """Waits until every queued write is done (tests, benchmarks, a draining worker)."""
        self._writes.join()

    def _write_forever(self) -> None:
        while True:
            key, token_ids, payload = self._writes.get()
            try:
                self._write(key, pack(token_ids, payload))
            finally:
                self._writes.task_done()

    def _write(self, key: str, value: bytes) -> None:
        tiers: list[LocalTier | RedisTier] = [*self.local]
        if self.remote is not None:
            tiers.append(self.remote)
        for tier in tiers:
            started = time.perf_counter()
            try:
                tier.put(key, value)
            except (OSError, RedisTierDown) as error:
                self.stats.write_failed(tier.name)
                log.warning("kv tier write failed", extra={"tier": tier.name, "error": str(error)})
                continue
            self.stats.wrote(tier.name, len(value), time.perf_counter() - started)

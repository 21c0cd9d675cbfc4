"""Keeps this scheduler's entries in Redis current, for the gateways' routing and admission:

- its load, a hash refreshed every few steps and at least every heartbeat, with a TTL, so a
  scheduler that stops publishing drops out by itself;
- the block hashes its prefix cache holds, one set per model and tenant salt, updated from the
  block manager's stored/evicted events in one pipeline per flush, with a TTL refreshed by the
  same heartbeat, so a dead scheduler's entries disappear.

Best effort: while Redis is unreachable the scheduler serves on; when Redis is back (or was
restarted and lost everything) the whole cache is republished.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as redis

from services.scheduler.load_report import LoadReporter
from services.scheduler.step_loop import StepLoop
from shared import redis_keys
from shared.redis_link import RedisLink

FLUSH_S = 0.1  # at most this stale while steps run
DEGRADED = "the scheduler's load and prefix cache are not published; it serves on regardless"


class RedisPublisher:
    def __init__(self, url: str, address: str, reporter: LoadReporter) -> None:
        self.link = RedisLink(url, degraded=DEGRADED)
        self.address = address
        self.reporter = reporter
        self.loop: StepLoop = reporter.loop
        self.load_key = redis_keys.scheduler_load(address)
        self._prefix_keys: set[str] = set()
        self.num_flushes = 0

    async def run(self) -> None:
        last_seen: tuple[int, int, int] | None = None
        last_flush = 0.0
        try:
            while True:
                await asyncio.sleep(FLUSH_S)
                now = time.monotonic()
                seen = self._moved()
                if seen != last_seen or now - last_flush >= redis_keys.HEARTBEAT_S:
                    last_seen, last_flush = seen, now
                    await self.flush()
        finally:
            await self.link.close()

    def _moved(self) -> tuple[int, int, int]:
        """What changes when the load does: a step ran, or a request was queued or left
        without one (an abort frees its blocks between steps; the gateways must see it)."""
        scheduler = self.loop.scheduler
        if scheduler is None:
            return self.loop.counters.steps, 0, 0
        return self.loop.counters.steps, len(scheduler.waiting), len(scheduler.running)

    async def flush(self) -> None:
        scheduler = self.loop.scheduler
        model = self.loop.model
        events = scheduler.block_manager.events if scheduler is not None else None
        if events is not None and events.needs_resync and model is not None:
            name = model.name
            if await self.link.run(lambda client: self._resync(client, name)) is None:
                events.request_resync()
                return
        delta = events.drain() if events is not None else None
        report = self.reporter.report()
        fields: dict[Any, Any] = {  # redis-py types keys invariantly
            "waiting": report.num_waiting,
            "waiting_tokens": report.num_waiting_tokens,
            "running": report.num_running,
            "free_blocks": report.num_free_blocks,
            "blocks": report.num_blocks,
            "queue_ms": round(report.queue_time_estimate_ms, 1),
            "drain_per_s": round(self.loop.queue_estimate.drain_per_s, 3),
            "slot_releases_s": ",".join(f"{s:.3f}" for s in report.slot_releases_s),
            "max_waiting": report.max_waiting,
            "max_running": self.loop.config.max_num_seqs,
            "ready": int(report.worker_ready),
            # Its worker loads blocks from the mesh's Redis tier: the router counts a prefix
            # cached on any worker as loadable there.
            "kv_shared_tier": int("redis" in self.loop.link.tiers.tiers),
            # name -> [weight, running, waiting, waiting tokens, blocks]: each tenant's hold,
            # which a gateway weighs its fair share against (watermarks.py).
            "tenants": json.dumps(
                {
                    t.tenant: [
                        t.weight,
                        t.num_running,
                        t.num_waiting,
                        t.num_waiting_tokens,
                        t.num_blocks,
                    ]
                    for t in report.tenants
                },
                separators=(",", ":"),
            ),
        }

        async def publish(client: redis.Redis) -> int:
            pipe = client.pipeline(transaction=False)
            pipe.hset(self.load_key, mapping=fields)
            pipe.pexpire(self.load_key, redis_keys.LOAD_TTL_MS)
            if delta is not None and model is not None:
                for salt, hashes in delta.stored.items():
                    key = redis_keys.prefix_blocks(model.name, salt, self.address)
                    self._prefix_keys.add(key)
                    pipe.sadd(key, *hashes)
                for salt, hashes in delta.evicted.items():
                    pipe.srem(redis_keys.prefix_blocks(model.name, salt, self.address), *hashes)
            for key in self._prefix_keys:
                pipe.pexpire(key, redis_keys.PREFIX_TTL_MS)
            results = await pipe.execute()
            return int(results[0])

        new_fields = await self.link.run(publish)
        self.num_flushes += 1
        # Lost events, or a load hash that had to be created (first flush, Redis restarted,
        # or our keys expired): Redis no longer mirrors the cache, so republish it whole.
        if events is not None and (new_fields is None or new_fields > 0):
            events.request_resync()

    async def _resync(self, client: redis.Redis, model: str) -> bool:
        pattern = redis_keys.prefix_blocks_pattern(model, self.address)
        stale = [key async for key in client.scan_iter(match=pattern, count=1000)]
        scheduler = self.loop.scheduler
        if scheduler is None:
            return True
        # Snapshot and clear the flag with no await in between: every event after this
        # snapshot is recorded and published by a later flush, in order.
        cached = scheduler.block_manager.cached_hashes()
        scheduler.block_manager.events.needs_resync = False
        pipe = client.pipeline(transaction=True)
        if stale:
            pipe.delete(*stale)
        self._prefix_keys = set()
        for salt, hashes in cached.items():
            key = redis_keys.prefix_blocks(model, salt, self.address)
            self._prefix_keys.add(key)
            pipe.sadd(key, *hashes)
            pipe.pexpire(key, redis_keys.PREFIX_TTL_MS)
        await pipe.execute()
        return True

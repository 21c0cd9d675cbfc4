"""Publishes the scheduler's load to Redis once a second, as a hash with a TTL (a heartbeat).

Best effort: when Redis is unreachable the scheduler serves on and retries next period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as redis

from shared import redis_keys
from shared.pb.kvmesh.v1 import scheduler_pb2

log = logging.getLogger("kvmesh.scheduler.load")


async def publish_load(
    url: str, address: str, report: Callable[[], scheduler_pb2.LoadReport], period_s: float = 1.0
) -> None:
    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    key = redis_keys.scheduler_load(address)
    healthy = True
    try:
        while True:
            load = report()
            fields: dict[Any, Any] = {  # redis-py types keys invariantly
                "waiting": load.num_waiting,
                "running": load.num_running,
                "free_blocks": load.num_free_blocks,
                "blocks": load.num_blocks,
                "ready": int(load.worker_ready),
            }
            try:
                async with client.pipeline(transaction=True) as pipe:
                    pipe.hset(key, mapping=fields)
                    pipe.pexpire(key, redis_keys.LOAD_TTL_MS)
                    await pipe.execute()
                if not healthy:
                    log.info("redis reachable again")
                healthy = True
            except (redis.RedisError, OSError) as error:
                if healthy:
                    log.warning(
                        "redis unreachable; load not published", extra={"error": str(error)}
                    )
                healthy = False
            await asyncio.sleep(period_s)
    finally:
        await client.aclose()

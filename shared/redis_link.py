"""A Redis connection that degrades instead of failing: short timeouts and a circuit breaker.

Redis holds signals, never request state. When a command fails or is slow the link is down:
callers get None at once (no request waits out a timeout while Redis is gone) and fall back
to local decisions; one call per `retry_s` probes again. Each transition is logged once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from shared import redis_auth

T = TypeVar("T")
log = logging.getLogger("kvmesh.redis")


class RedisLink:
    def __init__(
        self,
        url: str,
        *,
        degraded: str,
        timeout_s: float = 0.25,
        retry_s: float = 1.0,
    ) -> None:
        self.url = url
        self.degraded = degraded  # what falls back to what, for the log line
        self.retry_s = retry_s
        # One immediate retry: a pooled connection to a restarted server fails once, then
        # reconnects. More retries would only stretch the time a request waits on a dead Redis.
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
            **redis_auth.credentials(),
        )
        self.up = True
        self.recoveries = 0  # bumped each time Redis comes back: its contents may be gone
        self._next_probe = 0.0

    async def run(self, operation: Callable[[redis.Redis], Awaitable[T]]) -> T | None:
        """`operation`'s result, or None when Redis is down or the operation failed."""
        if not self.up and time.monotonic() < self._next_probe:
            return None
        try:
            result = await operation(self.client)
        except (redis.RedisError, OSError) as error:
            self._mark_down(error)
            return None
        if not self.up:
            self.up = True
            self.recoveries += 1
            log.warning("redis reachable again; no longer degraded")
        return result

    def _mark_down(self, error: Exception) -> None:
        self._next_probe = time.monotonic() + self.retry_s
        if self.up:
            self.up = False
            log.warning(
                f"redis unreachable; degrading: {self.degraded}",
                extra={
                    "redis": _without_password(self.url),
                    "error": f"{type(error).__name__}: {error}",
                },
            )

    async def close(self) -> None:
        await self.client.aclose()


def _without_password(url: str) -> str:
    """redis://user:secret@host -> redis://host: credentials never reach the logs."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rpartition("@")[2]

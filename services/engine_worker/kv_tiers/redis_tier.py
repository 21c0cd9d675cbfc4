"""The mesh's shared tier: blocks in Redis under their own byte budget and LRU (a sorted set of
keys by last use, trimmed in the same script that writes), so the KV blocks never crowd out the
mesh's load signals and prefix sets, whatever Redis's own maxmemory policy is.

Every call has a short timeout; after a failure the tier sits out a few seconds instead of
stalling every load on a dead server (the loads recompute meanwhile)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from shared import redis_auth

LRU_KEY = "kvmesh:kv:lru"
BYTES_KEY = "kvmesh:kv:bytes"
BACKOFF_S = 5.0

# KEYS: lru, bytes, key. ARGV: value, now, budget. Writes once; evicts least recently used.
_PUT = """
if redis.call('SET', KEYS[3], ARGV[1], 'NX') then
  redis.call('ZADD', KEYS[1], ARGV[2], KEYS[3])
  redis.call('INCRBY', KEYS[2], string.len(ARGV[1]))
end
local total = tonumber(redis.call('GET', KEYS[2]) or '0')
while total > tonumber(ARGV[3]) do
  local oldest = redis.call('ZPOPMIN', KEYS[1])
  if #oldest == 0 then break end
  local size = redis.call('STRLEN', oldest[1])
  redis.call('DEL', oldest[1])
  total = redis.call('DECRBY', KEYS[2], size)
end
return total
"""


class RedisTierDown(Exception):
    """Redis did not answer: a failed load, a failed write, never a stalled step."""


class RedisTier:
    name = "redis"

    def __init__(self, url: str, budget_bytes: int, timeout_s: float = 1.0) -> None:
        self.budget_bytes = budget_bytes
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            **redis_auth.credentials(),
        )
        self._put = self._client.register_script(_PUT)
        self._down_until = 0.0

    def _guard(self) -> None:
        if time.monotonic() < self._down_until:
            raise RedisTierDown("redis tier backing off after a failure")

    def _failed(self, error: Exception) -> RedisTierDown:
        self._down_until = time.monotonic() + BACKOFF_S
        return RedisTierDown(f"redis tier: {type(error).__name__}: {error}")

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        self._guard()
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(found) for found in pipe.execute()]
        except redis.RedisError as error:
            raise self._failed(error) from error

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """One round trip for every block of a load; each read refreshes its LRU place."""
        self._guard()
        now = time.time()
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.mget(list(keys))
            pipe.zadd(LRU_KEY, dict.fromkeys(keys, now), xx=True)
            values, _ = pipe.execute()
            return list(values)
        except redis.RedisError as error:
            raise self._failed(error) from error

    def put(self, key: str, value: bytes) -> None:
        self._guard()
        if len(value) > self.budget_bytes:
            return
        try:
            self._put(keys=[LRU_KEY, BYTES_KEY, key], args=[value, time.time(), self.budget_bytes])
        except redis.RedisError as error:
            raise self._failed(error) from error

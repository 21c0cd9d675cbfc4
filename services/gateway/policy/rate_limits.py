"""Per-tenant limits shared by every gateway: token buckets for requests/s and tokens/min, and a
concurrency limit, checked and charged by one Lua script (atomic: all or nothing).

A request is charged its prompt tokens plus max_tokens on admission; what it did not generate
is refunded when it ends. One refused after its prompt was tokenized is charged those tokens.
Concurrency is a sorted set of leases (request id -> expiry), renewed while the request runs,
so a gateway that dies stops counting after one lease.

With Redis unreachable each gateway enforces the same limits on its own (local buckets): a
tenant may then get up to the limit from each gateway, never an error caused by Redis.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from services.gateway.policy.leases import LEASE_MS, Leases
from shared import redis_keys
from shared.errors import KvmeshError, Reason
from shared.redis_link import RedisLink
from shared.tenants import Tenant

CONCURRENCY_RETRY_MS = 250

# Redis's clock now, and a bucket's level refilled to it: what each script below starts from.
BUCKET_LEVEL_LUA = """
local now_parts = redis.call('TIME')
local now = now_parts[1] * 1000 + math.floor(now_parts[2] / 1000)
local function level(key, rate, capacity)
  local state = redis.call('HMGET', key, 'level', 'at')
  local value = tonumber(state[1]) or capacity
  local at = tonumber(state[2]) or now
  return math.min(capacity, value + (now - at) * rate)
end
"""

# KEYS: requests bucket, tokens bucket, in-flight set
# ARGV: requests/ms, tokens/ms, max concurrent, token cost, request id, lease ms
# Returns {0, 0} when admitted, else {1 requests | 2 tokens | 3 concurrency, retry after ms}.
ADMIT_LUA = (
    BUCKET_LEVEL_LUA
    + """
local request_rate, token_rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_concurrent, token_cost = tonumber(ARGV[3]), tonumber(ARGV[4])
local request_capacity = math.max(1, request_rate * 1000)
local token_capacity = token_rate * 60000
local requests_left, tokens_left = 0, 0
if request_rate > 0 then
  requests_left = level(KEYS[1], request_rate, request_capacity)
  if requests_left < 1 then return {1, math.ceil((1 - requests_left) / request_rate)} end
end
if token_rate > 0 then
  token_cost = math.min(token_cost, token_capacity)
  tokens_left = level(KEYS[2], token_rate, token_capacity)
  if tokens_left < token_cost then
    return {2, math.ceil((token_cost - tokens_left) / token_rate)}
  end
end
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_concurrent then return {3, 0} end
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
end
if request_rate > 0 then
  redis.call('HSET', KEYS[1], 'level', requests_left - 1, 'at', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(request_capacity / request_rate) + 1000)
end
if token_rate > 0 then
  redis.call('HSET', KEYS[2], 'level', tokens_left - token_cost, 'at', now)
  redis.call('PEXPIRE', KEYS[2], math.ceil(token_capacity / token_rate) + 1000)
end
return {0, 0}
"""
)

# KEYS: tokens bucket, in-flight set. ARGV: tokens/ms, tokens to refund, request id.
RELEASE_LUA = """
redis.call('ZREM', KEYS[2], ARGV[3])
local rate, refund = tonumber(ARGV[1]), tonumber(ARGV[2])
if rate > 0 and refund > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  local value = tonumber(redis.call('HGET', KEYS[1], 'level'))
  redis.call('HSET', KEYS[1], 'level', math.min(rate * 60000, value + refund))
end
return 0
"""

# KEYS: tokens bucket. ARGV: tokens/ms, tokens to take (never below empty).
CHARGE_LUA = (
    BUCKET_LEVEL_LUA
    + """
local rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2])
local capacity = rate * 60000
local left = level(KEYS[1], rate, capacity)
redis.call('HSET', KEYS[1], 'level', math.max(0, left - cost), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate) + 1000)
return 0
"""
)

_LIMIT_NAMES = {1: "requests per second", 2: "tokens per minute", 3: "concurrent requests"}


@dataclass
class Grant:
    """One admitted request's charge, to release when it ends."""

    tenant: Tenant
    request_id: str
    tokens_charged: int
    shared: bool  # admitted through Redis (else by this gateway's local buckets)


class LocalBucket:
    def __init__(self, rate_per_s: float, capacity: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self.at = time.monotonic()

    def refill(self) -> float:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate_per_s)
        self.at = now
        return self.level


class LocalLimits:
    """One tenant's limits enforced by this gateway alone (Redis unreachable)."""

    def __init__(self, tenant: Tenant) -> None:
        limits = tenant.limits
        rps, tpm = limits.requests_per_second, limits.tokens_per_minute
        self.requests = LocalBucket(rps, max(1.0, rps)) if rps else None
        self.tokens = LocalBucket(tpm / 60, tpm) if tpm else None
        self.max_concurrent = limits.max_concurrent
        self.in_flight = 0

    def admit(self, token_cost: int) -> tuple[int, int]:
        if self.requests is not None and self.requests.refill() < 1:
            return 1, math.ceil((1 - self.requests.level) / self.requests.rate_per_s * 1e3)
        if self.tokens is not None:
            token_cost = min(token_cost, int(self.tokens.capacity))
            if self.tokens.refill() < token_cost:
                wait_s = (token_cost - self.tokens.level) / self.tokens.rate_per_s
                return 2, math.ceil(wait_s * 1e3)
        if self.max_concurrent and self.in_flight >= self.max_concurrent:
            return 3, 0
        if self.requests is not None:
            self.requests.level -= 1
        if self.tokens is not None:
            self.tokens.level -= token_cost
        self.in_flight += 1
        return 0, 0

    def charge(self, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.level = max(0.0, self.tokens.refill() - tokens)

    def release(self, refund: int) -> None:
        self.in_flight -= 1
        if self.tokens is not None:
            self.tokens.level = min(self.tokens.capacity, self.tokens.refill() + refund)


class RateLimiter:
    def __init__(self, link: RedisLink | None) -> None:
        self.link = link
        self._local: dict[str, LocalLimits] = {}
        self._leases = Leases(link) if link is not None else None  # concurrency leases
        if link is not None:  # EVALSHA; reloaded by redis-py after a Redis restart
            self._admit_script = link.client.register_script(ADMIT_LUA)
            self._release_script = link.client.register_script(RELEASE_LUA)
            self._charge_script = link.client.register_script(CHARGE_LUA)

    async def admit(self, tenant: Tenant, request_id: str, token_cost: int) -> Grant | None:
        """Charge the tenant or raise RATE_LIMITED; None for a tenant without limits."""
        if tenant.limits.unlimited:
            return None
        verdict = await self._admit_shared(tenant, request_id, token_cost)
        shared = verdict is not None
        if verdict is None:
            verdict = self._local_limits(tenant).admit(token_cost)
        status, retry_ms = verdict
        if status:
            raise KvmeshError(
                Reason.RATE_LIMITED,
                f"tenant {tenant.name!r} is over its limit of {_LIMIT_NAMES[status]}",
                retryable=True,
                retry_after_ms=max(retry_ms, CONCURRENCY_RETRY_MS if status == 3 else 1),
            )
        charged = min(token_cost, int(tenant.limits.tokens_per_minute)) or token_cost
        grant = Grant(tenant, request_id, charged, shared)
        if shared and tenant.limits.max_concurrent and self._leases is not None:
            self._leases.hold(redis_keys.tenant_in_flight(tenant.name), request_id)
        return grant

    async def charge(self, tenant: Tenant, tokens: int) -> None:
        """Prompt tokens the tenant had tokenized for a request refused before admission (too
        long, or no room for its output): taken from its tokens per minute, never below empty,
        so tokenizer time counts against its limit even when nothing is generated."""
        rate = tenant.limits.tokens_per_minute
        if rate <= 0 or tokens <= 0:
            return
        if self.link is not None:
            keys = [redis_keys.tenant_tokens_bucket(tenant.name)]
            args: list[float | int | str] = [rate / 60000, tokens]
            done = await self.link.run(lambda client: self._charge_script(keys=keys, args=args))
            if done is not None:
                return
        self._local_limits(tenant).charge(tokens)

    async def release(self, grant: Grant | None, tokens_used: int) -> None:
        if grant is None:
            return
        refund = max(0, grant.tokens_charged - tokens_used)
        if not grant.shared:
            self._local_limits(grant.tenant).release(refund)
            return
        tenant = grant.tenant
        if self._leases is None or self.link is None:
            return
        self._leases.drop(redis_keys.tenant_in_flight(tenant.name), grant.request_id)
        keys = [
            redis_keys.tenant_tokens_bucket(tenant.name),
            redis_keys.tenant_in_flight(tenant.name),
        ]
        args: list[float | int | str] = [
            tenant.limits.tokens_per_minute / 60000,
            refund,
            grant.request_id,
        ]
        # If Redis is down now, the lease expires by itself within LEASE_MS.
        await self.link.run(lambda client: self._release_script(keys=keys, args=args))

    async def _admit_shared(
        self, tenant: Tenant, request_id: str, token_cost: int
    ) -> tuple[int, int] | None:
        if self.link is None:
            return None
        limits = tenant.limits
        keys = [
            redis_keys.tenant_requests_bucket(tenant.name),
            redis_keys.tenant_tokens_bucket(tenant.name),
            redis_keys.tenant_in_flight(tenant.name),
        ]
        args: list[float | int | str] = [
            limits.requests_per_second / 1000,
            limits.tokens_per_minute / 60000,
            limits.max_concurrent,
            token_cost,
            request_id,
            LEASE_MS,
        ]
        reply = await self.link.run(lambda client: self._admit_script(keys=keys, args=args))
        return None if reply is None else (int(reply[0]), int(reply[1]))

    def _local_limits(self, tenant: Tenant) -> LocalLimits:
        local = self._local.get(tenant.name)
        if local is None:
            local = self._local[tenant.name] = LocalLimits(tenant)
        return local

    async def close(self) -> None:
        if self._leases is not None:
            await self._leases.close()

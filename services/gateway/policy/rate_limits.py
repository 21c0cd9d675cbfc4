"""Per-tenant limits shared by every gateway: token buckets for requests/s and tokens/min, and a
concurrency limit, checked and charged by one Lua script (atomic: all or nothing).

A request is charged its prompt tokens plus n x max_tokens on admission; what it did not
generate is refunded when it ends. One refused after its prompt was tokenized is charged those
tokens. What a tenant has in flight is a sorted set of leases (member -> expiry), renewed while
the request runs, so a gateway that dies stops counting after one lease: a member per sequence
(each of a request's n completions counts against `max_concurrent`), the first carrying the
request's tokens as "tokens|request id" (their sum is checked against `max_in_flight_tokens`).

With Redis unreachable each gateway enforces the same limits on its own (local buckets): a
tenant may then get up to the limit from each gateway, never an error caused by Redis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.gateway.policy.leases import LEASE_MS, Leases
from services.gateway.policy.local_limits import (
    OVER_CONCURRENCY,
    OVER_IN_FLIGHT_TOKENS,
    OVER_REQUESTS,
    OVER_TOKENS,
    LocalLimits,
)
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
# ARGV: requests/ms, tokens/ms, max concurrent, token cost, max in-flight tokens, lease ms,
# then the request's lease members (lease_members).
# Returns {0, 0} when admitted, else {1 requests | 2 tokens | 3 concurrency | 4 in-flight
# tokens, retry after ms}.
ADMIT_LUA = (
    BUCKET_LEVEL_LUA
    + """
local request_rate, token_rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_concurrent, token_cost = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_in_flight, in_flight_cost = tonumber(ARGV[5]), tonumber(ARGV[4])
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
if max_concurrent > 0 or max_in_flight > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local members = #ARGV - 6
  if max_concurrent > 0 and redis.call('ZCARD', KEYS[3]) + members > max_concurrent then
    return {3, 0}
  end
  if max_in_flight > 0 then
    local held = 0
    for _, member in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
      held = held + (tonumber(string.match(member, '^(%d+)|')) or 0)
    end
    if held + in_flight_cost > max_in_flight then return {4, 0} end
  end
  for index = 7, #ARGV do redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[index]) end
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

# KEYS: tokens bucket, in-flight set. ARGV: tokens/ms, tokens to refund, lease members.
RELEASE_LUA = """
for index = 3, #ARGV do redis.call('ZREM', KEYS[2], ARGV[index]) end
local rate, refund = tonumber(ARGV[1]), tonumber(ARGV[2])
if rate > 0 and refund > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  local value = tonumber(redis.call('HGET', KEYS[1], 'level'))
  redis.call('HSET', KEYS[1], 'level', math.min(rate * 60000, value + refund))
end
return 0
"""

# KEYS: tokens bucket. ARGV: tokens/ms, tokens to take (never below empty). Returns the whole
# tokens there were before.
CHARGE_LUA = (
    BUCKET_LEVEL_LUA
    + """
local rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2])
local capacity = rate * 60000
local left = level(KEYS[1], rate, capacity)
redis.call('HSET', KEYS[1], 'level', math.max(0, left - cost), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate) + 1000)
return math.floor(left)
"""
)

_LIMIT_NAMES = {
    OVER_REQUESTS: "requests per second",
    OVER_TOKENS: "tokens per minute",
    OVER_CONCURRENCY: "concurrent sequences (max_concurrent; each of n counts)",
    OVER_IN_FLIGHT_TOKENS: "tokens in flight (max_in_flight_tokens)",
}


def lease_members(request_id: str, num_sequences: int, tokens: int) -> list[str]:
    """A request's members of its tenant's in-flight set: one per sequence, the first
    carrying its tokens (prompt + n x max_tokens)."""
    rest = (f"0|{request_id}#{index}" for index in range(1, num_sequences))
    return [f"{tokens}|{request_id}", *rest]


@dataclass
class Grant:
    """One admitted request's charge, to release when it ends."""

    tenant: Tenant
    tokens_charged: int
    shared: bool  # admitted through Redis (else by this gateway's local buckets)
    members: list[str]  # its leases in the tenant's in-flight set (lease_members)
    in_flight_tokens: int


class RateLimiter:
    def __init__(self, link: RedisLink | None) -> None:
        self.link = link
        self._local: dict[str, LocalLimits] = {}
        self._leases = Leases(link) if link is not None else None  # concurrency leases
        if link is not None:  # EVALSHA; reloaded by redis-py after a Redis restart
            self._admit_script = link.client.register_script(ADMIT_LUA)
            self._release_script = link.client.register_script(RELEASE_LUA)
            self._charge_script = link.client.register_script(CHARGE_LUA)

    async def admit(
        self, tenant: Tenant, request_id: str, token_cost: int, num_sequences: int = 1
    ) -> Grant | None:
        """Charge the tenant or raise RATE_LIMITED; None for a tenant without limits.
        `token_cost`: prompt + n x max_tokens; `num_sequences`: n."""
        limits = tenant.limits
        if limits.unlimited:
            return None
        _check_fits(tenant, token_cost, num_sequences)
        members = lease_members(request_id, num_sequences, token_cost)
        verdict = await self._admit_shared(tenant, members, token_cost)
        shared = verdict is not None
        if verdict is None:
            verdict = self._local_limits(tenant).admit(token_cost, num_sequences)
        status, retry_ms = verdict
        if status:
            waits = status in (OVER_CONCURRENCY, OVER_IN_FLIGHT_TOKENS)
            raise KvmeshError(
                Reason.RATE_LIMITED,
                f"tenant {tenant.name!r} is over its limit of {_LIMIT_NAMES[status]}",
                retryable=True,
                retry_after_ms=max(retry_ms, CONCURRENCY_RETRY_MS if waits else 1),
            )
        charged = min(token_cost, int(limits.tokens_per_minute)) or token_cost
        grant = Grant(tenant, charged, shared, members, token_cost)
        if shared and _leased(tenant) and self._leases is not None:
            for member in members:
                self._leases.hold(redis_keys.tenant_in_flight(tenant.name), member)
        return grant

    async def charge(self, tenant: Tenant, tokens: int) -> float | None:
        """Tokens the tenant had tokenized without a generation admitted (a prompt refused
        before admission, a Tokenize call): taken from its tokens per minute, never below
        empty, so tokenizer time counts against its limit. Returns the tokens it had before
        (0 tokens: only asks), None for a tenant without that limit."""
        rate = tenant.limits.tokens_per_minute
        if rate <= 0 or tokens < 0:
            return None
        if self.link is not None:
            keys = [redis_keys.tenant_tokens_bucket(tenant.name)]
            args: list[float | int | str] = [rate / 60000, tokens]
            left = await self.link.run(lambda client: self._charge_script(keys=keys, args=args))
            if left is not None:
                return float(left)
        return self._local_limits(tenant).charge(tokens)

    async def require_tokens_left(self, tenant: Tenant) -> None:
        """RATE_LIMITED when the tenant's tokens per minute are spent: a call that only
        tokenizes is refused before it costs the tokenizer anything."""
        left = await self.charge(tenant, 0)
        if left is not None and left < 1:
            raise KvmeshError(
                Reason.RATE_LIMITED,
                f"tenant {tenant.name!r} is over its limit of tokens per minute (tokenizing "
                f"counts against it)",
                retryable=True,
                retry_after_ms=max(1, math.ceil(60000 / tenant.limits.tokens_per_minute)),
            )

    async def release(self, grant: Grant | None, tokens_used: int) -> None:
        if grant is None:
            return
        refund = max(0, grant.tokens_charged - tokens_used)
        tenant = grant.tenant
        if not grant.shared:
            local = self._local_limits(tenant)
            local.release(refund, len(grant.members), grant.in_flight_tokens)
            return
        if self._leases is None or self.link is None:
            return
        in_flight = redis_keys.tenant_in_flight(tenant.name)
        for member in grant.members:
            self._leases.drop(in_flight, member)
        keys = [redis_keys.tenant_tokens_bucket(tenant.name), in_flight]
        args: list[float | int | str] = [tenant.limits.tokens_per_minute / 60000, refund]
        args += grant.members
        # If Redis is down now, the lease expires by itself within LEASE_MS.
        await self.link.run(lambda client: self._release_script(keys=keys, args=args))

    async def _admit_shared(
        self, tenant: Tenant, members: list[str], token_cost: int
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
            limits.max_in_flight_tokens,
            LEASE_MS,
            *members,
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


def _leased(tenant: Tenant) -> bool:
    """Whether its requests hold leases in its in-flight set."""
    return bool(tenant.limits.max_concurrent or tenant.limits.max_in_flight_tokens)


def _check_fits(tenant: Tenant, token_cost: int, num_sequences: int) -> None:
    """A request past what its tenant may ever hold at once is refused for good."""
    limits = tenant.limits
    if limits.max_concurrent and num_sequences > limits.max_concurrent:
        raise KvmeshError(
            Reason.RATE_LIMITED,
            f"n = {num_sequences} is more sequences than tenant {tenant.name!r} may run at once "
            f"(max_concurrent {limits.max_concurrent})",
        )
    if limits.max_in_flight_tokens and token_cost > limits.max_in_flight_tokens:
        raise KvmeshError(
            Reason.RATE_LIMITED,
            f"prompt + n x max_tokens = {token_cost} tokens is more than tenant "
            f"{tenant.name!r} may have in flight (max_in_flight_tokens "
            f"{limits.max_in_flight_tokens}): lower max_tokens or n",
        )

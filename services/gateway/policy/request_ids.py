"""A client's own request id names at most one open request of its tenant, across every gateway
of the mesh (several share a port: the next call may reach any of them). Each gateway refuses
an id its tenant has open on it, and claims a new one in Redis (a sorted set per tenant, id ->
lease, see leases.py) so that the others refuse it too. Generated ids are random and claim
nothing. With Redis unreachable each gateway checks its own requests only: a reused id is then
refused by the gateway or the scheduler that holds it, never an error caused by Redis."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.gateway.policy.leases import LEASE_MS, Leases
from shared import redis_keys
from shared.errors import KvmeshError, Reason
from shared.redis_link import RedisLink

# KEYS: the tenant's claimed ids. ARGV: request id, lease ms. Returns 1 when already claimed.
CLAIM_LUA = """
local now_parts = redis.call('TIME')
local now = now_parts[1] * 1000 + math.floor(now_parts[2] / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZADD', KEYS[1], 'NX', now + lease, ARGV[1]) == 0 then return 1 end
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
return 0
"""


def in_use(request_id: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_ARGUMENT, f"request id {request_id!r} is in use")


@dataclass
class Claim:
    key: str  # the tenant's claimed-ids set
    request_id: str
    released: bool = False


class RequestIds:
    def __init__(self, link: RedisLink | None) -> None:
        self.link = link
        self._leases = Leases(link) if link is not None else None
        self._releases: set[asyncio.Task[int | None]] = set()
        if link is not None:
            self._claim_script = link.client.register_script(CLAIM_LUA)

    async def claim(self, tenant: str, request_id: str) -> Claim | None:
        """The claim on a client's id, held until released; raises `in_use` when another
        request of the tenant holds it; None without Redis."""
        if self.link is None or self._leases is None:
            return None
        key = redis_keys.tenant_request_ids(tenant)
        args: list[str | int] = [request_id, LEASE_MS]
        taken = await self.link.run(lambda client: self._claim_script(keys=[key], args=args))
        if taken is None:
            return None
        if int(taken):
            raise in_use(request_id)
        self._leases.hold(key, request_id)
        return Claim(key, request_id)

    def release(self, claim: Claim | None) -> None:
        """Frees the id in the background (once; the lease lapses by itself if Redis is down):
        a stream's cleanup never waits on Redis."""
        if claim is None or claim.released or self.link is None or self._leases is None:
            return
        claim.released = True
        self._leases.drop(claim.key, claim.request_id)
        link = self.link
        task = asyncio.create_task(link.run(lambda c: c.zrem(claim.key, claim.request_id)))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def close(self) -> None:
        if self._leases is not None:
            await self._leases.close()

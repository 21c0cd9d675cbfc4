"""What a gateway holds in Redis while a request runs: members of sorted sets (member -> expiry,
Redis's clock, ms), renewed every third of a lease, so a gateway that dies stops holding them
within one lease and nothing has to clean up after it."""

from __future__ import annotations

import asyncio
import contextlib
import functools

import redis.asyncio as redis

from shared.redis_link import RedisLink

LEASE_MS = 30_000

# KEYS: a sorted set. ARGV: lease ms, members still held (renewed only if still present).
RENEW_LUA = """
local now_parts = redis.call('TIME')
local now = now_parts[1] * 1000 + math.floor(now_parts[2] / 1000)
local lease = tonumber(ARGV[1])
for index = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[index]) end
redis.call('PEXPIRE', KEYS[1], lease)
return 0
"""


class Leases:
    def __init__(self, link: RedisLink) -> None:
        self.link = link
        self._held: dict[str, set[str]] = {}  # sorted set key -> members
        self._renewer: asyncio.Task[None] | None = None
        self._renew_script = link.client.register_script(RENEW_LUA)

    def hold(self, key: str, member: str) -> None:
        """Renew `member` of `key` (already added, with a lease) until dropped."""
        self._held.setdefault(key, set()).add(member)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_while_held())

    def drop(self, key: str, member: str) -> None:
        members = self._held.get(key)
        if members is not None:
            members.discard(member)
            if not members:
                del self._held[key]

    async def _renew_while_held(self) -> None:
        while self._held:
            await asyncio.sleep(LEASE_MS / 3e3)
            held = {key: sorted(members) for key, members in self._held.items()}
            await self.link.run(functools.partial(self._renew, held=held))

    async def _renew(self, client: redis.Redis, held: dict[str, list[str]]) -> None:
        pipe = client.pipeline(transaction=False)
        for key, members in held.items():
            await self._renew_script(keys=[key], args=[LEASE_MS, *members], client=pipe)
        await pipe.execute()

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer

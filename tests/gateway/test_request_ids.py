"""A client's request id held across gateways: claims in a real redis-server, renewed while held,
lapsing when the gateway holding them dies, and no error at all without Redis."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.policy import leases, request_ids
from services.gateway.policy.request_ids import RequestIds
from shared.errors import KvmeshError, Reason
from shared.redis_link import RedisLink
from tests.redis_server import RedisServer


def gateway(server: RedisServer) -> RequestIds:
    return RequestIds(RedisLink(server.url, degraded="tests", retry_s=0.0))


async def refused(ids: RequestIds, tenant: str, request_id: str) -> None:
    with pytest.raises(KvmeshError) as raised:
        await ids.claim(tenant, request_id)
    assert raised.value.reason is Reason.INVALID_ARGUMENT and not raised.value.retryable
    assert "in use" in raised.value.message


async def test_an_id_open_on_one_gateway_is_refused_by_another_until_released(
    redis_server: RedisServer,
) -> None:
    first, second = gateway(redis_server), gateway(redis_server)
    claim = await first.claim("acme", "order-7")
    assert claim is not None
    await refused(second, "acme", "order-7")
    assert await second.claim("beta", "order-7") is not None  # another tenant's namespace
    first.release(claim)
    first.release(claim)  # once: a second release is a no-op
    await asyncio.sleep(0.05)  # the release runs in the background
    assert await second.claim("acme", "order-7") is not None
    await first.close()
    await second.close()


async def test_a_held_claim_is_renewed_and_a_dead_gateways_lapses(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease_ms = 400
    monkeypatch.setattr(request_ids, "LEASE_MS", lease_ms)
    monkeypatch.setattr(leases, "LEASE_MS", lease_ms)
    first, second = gateway(redis_server), gateway(redis_server)
    assert await first.claim("acme", "long") is not None
    await asyncio.sleep(3 * lease_ms / 1e3)  # past the first lease: renewed meanwhile
    await refused(second, "acme", "long")
    await first.close()  # the gateway dies: nobody releases, nobody renews
    await asyncio.sleep(2 * lease_ms / 1e3)
    assert await second.claim("acme", "long") is not None
    await second.close()


async def test_without_redis_a_claim_is_nothing_and_never_an_error() -> None:
    dead = RedisServer()  # never started
    ids = RequestIds(RedisLink(dead.url, degraded="tests"))
    assert await ids.claim("acme", "r1") is None
    assert await ids.claim("acme", "r1") is None
    ids.release(None)
    assert await RequestIds(None).claim("acme", "r1") is None

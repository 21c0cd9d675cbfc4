"""Per-tenant limits: the Lua token buckets and leases in a real redis-server, and the local
buckets each gateway falls back to without Redis."""

from __future__ import annotations

import pytest

from services.gateway.policy.rate_limits import RateLimiter
from shared.errors import KvmeshError, Reason
from shared.redis_link import RedisLink
from shared.tenants import Tenant, TenantLimits
from tests.redis_server import RedisServer


def limiter(server: RedisServer) -> RateLimiter:
    return RateLimiter(RedisLink(server.url, degraded="tests", retry_s=0.0))


async def refused(
    limiter: RateLimiter, tenant: Tenant, request_id: str, tokens: int, num_sequences: int = 1
) -> int:
    with pytest.raises(KvmeshError) as raised:
        await limiter.admit(tenant, request_id, tokens, num_sequences)
    error = raised.value
    assert error.reason is Reason.RATE_LIMITED and error.retryable
    return error.retry_after_ms


async def test_requests_per_second_is_shared_by_every_gateway(redis_server: RedisServer) -> None:
    tenant = Tenant("acme", TenantLimits(requests_per_second=2))
    first, second = limiter(redis_server), limiter(redis_server)  # two gateways
    await first.admit(tenant, "r1", 10)
    await second.admit(tenant, "r2", 10)
    retry_ms = await refused(first, tenant, "r3", 10)
    assert 0 < retry_ms <= 500  # one token refills in 500 ms


async def test_tokens_per_minute_charges_prompt_and_max_tokens_and_refunds_unused(
    redis_server: RedisServer,
) -> None:
    tenant = Tenant("acme", TenantLimits(tokens_per_minute=600))  # 10 tokens/s
    limits = limiter(redis_server)
    grant = await limits.admit(tenant, "big", 500)
    retry_ms = await refused(limits, tenant, "next", 200)
    assert 9_000 <= retry_ms <= 10_100  # 100 missing tokens at 10/s
    await limits.release(grant, tokens_used=100)  # 400 of the 500 came back
    await limits.admit(tenant, "next", 200)


async def test_concurrency_limit_counts_requests_until_released(
    redis_server: RedisServer,
) -> None:
    tenant = Tenant("acme", TenantLimits(max_concurrent=1))
    limits = limiter(redis_server)
    grant = await limits.admit(tenant, "one", 1)
    await refused(limits, tenant, "two", 1)
    await limits.release(grant, 1)
    await limits.admit(tenant, "two", 1)
    await limits.close()


async def test_tenants_do_not_share_buckets(redis_server: RedisServer) -> None:
    limits = limiter(redis_server)
    acme = Tenant("acme", TenantLimits(requests_per_second=1))
    beta = Tenant("beta", TenantLimits(requests_per_second=1))
    await limits.admit(acme, "a1", 1)
    await refused(limits, acme, "a2", 1)
    await limits.admit(beta, "b1", 1)


async def test_without_redis_each_gateway_enforces_the_limits_locally() -> None:
    dead = RedisServer()  # never started
    limits = RateLimiter(RedisLink(dead.url, degraded="tests"))
    tenant = Tenant("acme", TenantLimits(requests_per_second=1, max_concurrent=5))
    grant = await limits.admit(tenant, "r1", 1)
    assert grant is not None and not grant.shared
    await refused(limits, tenant, "r2", 1)
    await limits.release(grant, 1)


async def test_unlimited_tenants_never_touch_redis() -> None:
    limits = RateLimiter(None)
    assert await limits.admit(Tenant("anonymous"), "r", 10**6) is None


async def test_a_charge_empties_the_tokens_bucket_and_never_below(
    redis_server: RedisServer,
) -> None:
    """Tokens a refused request had tokenized: the next admission waits for them to refill,
    and no charge leaves a debt past an empty bucket. Upper bounds only: time passing
    refills the bucket, which shortens a wait and never lengthens it."""
    tenant = Tenant("charged", TenantLimits(tokens_per_minute=600))  # 10 tokens/s
    for limits in (limiter(redis_server), RateLimiter(None)):  # through Redis, and locally
        await limits.charge(tenant, 590)
        assert await refused(limits, tenant, "after", 100) <= 9_000  # 10 of 100 were left
        await limits.charge(tenant, 10_000)  # far past empty: empty, not a debt
        # A debt of 9,900 tokens would be a wait of 1,000 s; empty is the cost's own 10 s.
        assert await refused(limits, tenant, "emptied", 100) <= 10_000
        await limits.charge(Tenant("free", TenantLimits()), 10_000)  # no limit: nothing


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "local"])
async def test_each_of_n_counts_against_concurrency_and_its_tokens_against_in_flight(
    redis_server: RedisServer, shared: bool
) -> None:
    tenant = Tenant("nn", TenantLimits(max_concurrent=8, max_in_flight_tokens=1000))
    limits = limiter(redis_server) if shared else RateLimiter(None)
    wide = await limits.admit(tenant, "wide", 300, num_sequences=6)
    assert wide is not None and wide.shared is shared and len(wide.members) == 6
    await refused(limits, tenant, "three-more", 10, num_sequences=3)  # 6 + 3 > 8
    two = await limits.admit(tenant, "two-more", 10, num_sequences=2)
    await limits.release(two, 10)
    await refused(limits, tenant, "tokens", 701)  # 300 held + 701 > 1000
    held = await limits.admit(tenant, "tokens", 700)
    await limits.release(wide, 300)
    await limits.release(held, 700)
    # Both came back: the whole allowance fits again.
    await limits.release(await limits.admit(tenant, "all", 1000, num_sequences=8), 0)
    await limits.close()


async def test_a_request_past_what_its_tenant_may_ever_hold_is_refused_for_good() -> None:
    tenant = Tenant("small", TenantLimits(max_concurrent=4, max_in_flight_tokens=100))
    limits = RateLimiter(None)
    for tokens, n, words in ((10, 5, "n = 5"), (101, 1, "max_in_flight_tokens 100")):
        with pytest.raises(KvmeshError) as raised:
            await limits.admit(tenant, "big", tokens, num_sequences=n)
        error = raised.value
        assert (error.reason, error.retryable) == (Reason.RATE_LIMITED, False)
        assert words in error.message

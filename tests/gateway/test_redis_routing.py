"""Cache-aware routing and admission through a real redis-server: the scheduler's publisher
writes its prefix cache and load, the gateway's router reads them back."""

from __future__ import annotations

import pytest
import redis.asyncio as redis

from services.gateway.mesh.connections import SchedulerBackend
from services.gateway.mesh.router import Router
from services.gateway.mesh.watermarks import TenantAsk, Watermarks
from services.scheduler.load_report import LoadReporter
from services.scheduler.redis_publisher import RedisPublisher
from services.scheduler.step_loop import StepLoop
from shared import redis_keys
from shared.block_hash import hash_full_blocks
from shared.config import SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2
from shared.redis_link import RedisLink
from shared.sampling import SamplingParams
from tests.redis_server import RedisServer
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import make_scheduler, run_to_completion, step

MODEL = common_pb2.ModelInfo(name="tiny", kv_block_size=4)
PROMPT = list(range(1, 42))  # 10 full blocks of 4, and one more token
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


async def _unused_readiness(ready: bool) -> None:
    pass


def scheduler_service(address: str, max_seqs: int = 16) -> LoadReporter:
    """A scheduler's step loop with its pure scheduler attached and no worker (none is needed
    to publish what the cache holds), and its load reporter."""
    config = SchedulerConfig(max_num_seqs=max_seqs)
    loop = StepLoop(config, True, "127.0.0.1:1", _unused_readiness)
    loop.scheduler = make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=max_seqs)
    loop.model = MODEL
    return LoadReporter(loop, 64)


def backend(address: str) -> SchedulerBackend:
    backend = SchedulerBackend(address)
    backend.model = MODEL
    return backend


def link(server: RedisServer) -> RedisLink:
    return RedisLink(server.url, degraded="tests", retry_s=0.1)


async def test_gateway_routes_to_the_scheduler_that_published_the_prefix(
    redis_server: RedisServer,
) -> None:
    cached, empty = scheduler_service("s-cached:1"), scheduler_service("s-empty:2")
    salt = b"tenant-a"
    assert cached.loop.scheduler is not None
    cached.loop.scheduler.add_request("warm", PROMPT, ONE_TOKEN, cache_salt=salt)
    run_to_completion(cached.loop.scheduler, FakeWorker(4))
    for service, address in ((cached, "s-cached:1"), (empty, "s-empty:2")):
        await RedisPublisher(redis_server.url, address, service).flush()
    router = Router(link(redis_server))
    backends = [backend("s-empty:2"), backend("s-cached:1")]

    decision = await router.route(backends, PROMPT, salt)
    assert decision.backend.address == "s-cached:1"
    assert (decision.matched_blocks, decision.reason) == (10, "prefix")
    assert decision.uncached_tokens == 1
    # The same prompt for another tenant matches nothing: salts scope the keys and hashes.
    other = await router.route(backends, PROMPT, b"tenant-b")
    assert (other.matched_blocks, other.reason) == (0, "least-loaded")
    # A prompt that shares the first 5 blocks only.
    forked = PROMPT[:20] + [999] * 21
    assert (await router.route(backends, forked, salt)).matched_blocks == 5


async def test_a_long_queue_outweighs_a_cached_prefix(redis_server: RedisServer) -> None:
    router = Router(link(redis_server))
    client = redis.Redis.from_url(redis_server.url)
    key = redis_keys.prefix_blocks("tiny", b"", "busy:1")
    await client.sadd(key, *hash_full_blocks(PROMPT[:40], 4))
    await client.hset(redis_keys.scheduler_load("busy:1"), mapping={"waiting_tokens": 30})
    backends = [backend("busy:1"), backend("idle:2")]
    assert (await router.route(backends, PROMPT, b"")).backend.address == "busy:1"
    # Queued work beyond two whole prefills elsewhere: the idle worker wins despite no prefix.
    await client.hset(redis_keys.scheduler_load("busy:1"), mapping={"waiting_tokens": 90})
    decision = await router.route(backends, PROMPT, b"")
    assert (decision.backend.address, decision.reason) == ("idle:2", "load")
    await client.aclose()


async def test_a_busy_prefix_holder_loses_to_a_worker_that_can_load_the_prefix(
    redis_server: RedisServer,
) -> None:
    router = Router(link(redis_server))
    client = redis.Redis.from_url(redis_server.url)
    key = redis_keys.prefix_blocks("tiny", b"", "busy:1")
    await client.sadd(key, *hash_full_blocks(PROMPT[:40], 4))
    busy = {"waiting_tokens": 90}
    await client.hset(redis_keys.scheduler_load("busy:1"), mapping={**busy, "kv_shared_tier": 1})
    for address in ("plain:2", "loads:3"):
        tier = {"kv_shared_tier": int(address == "loads:3"), "waiting_tokens": 0}
        await client.hset(redis_keys.scheduler_load(address), mapping=tier)
    backends = [backend("busy:1"), backend("plain:2"), backend("loads:3")]
    # The holder's queue outweighs its prefix; of the idle two, the one with the mesh's Redis
    # tier loads what the holder wrote through instead of computing it.
    decision = await router.route(backends, PROMPT, b"")
    assert (decision.backend.address, decision.reason) == ("loads:3", "load")
    # Idle, the holder itself is cheapest: its pool has the prefix, nothing to load.
    await client.hset(redis_keys.scheduler_load("busy:1"), mapping={"waiting_tokens": 0})
    assert (await router.route(backends, PROMPT, b"")).backend.address == "busy:1"
    await client.aclose()


async def test_past_the_watermarks_the_router_refuses_with_a_drain_time(
    redis_server: RedisServer,
) -> None:
    router = Router(link(redis_server), watermarks=Watermarks(max_queue_ms=1000))
    client = redis.Redis.from_url(redis_server.url)
    # Draining 10 requests/s, a request behind 29 waits 3 s, behind 24, 2.5 s.
    for address, waiting in (("a:1", 29), ("b:2", 24)):
        await client.hset(
            redis_keys.scheduler_load(address),
            mapping={"waiting": waiting, "drain_per_s": 10},
        )
    with pytest.raises(KvmeshError) as raised:
        await router.route([backend("a:1"), backend("b:2")], PROMPT, b"")
    error = raised.value
    assert error.reason is Reason.OVERLOADED and error.retryable
    assert error.retry_after_ms == 1500  # b drains to the 1 s watermark in 1.5 s
    await client.hset(redis_keys.scheduler_load("b:2"), mapping={"waiting": 4})
    decision = await router.route([backend("a:1"), backend("b:2")], PROMPT, b"")
    assert decision.backend.address == "b:2"
    await client.aclose()


async def test_past_the_watermarks_a_tenant_below_its_share_is_still_admitted(
    redis_server: RedisServer,
) -> None:
    service = scheduler_service("shared:1", max_seqs=8)
    scheduler = service.loop.scheduler
    assert scheduler is not None
    long = SamplingParams(max_tokens=50, temperature=0.0)
    for index in range(10):  # 7 in the batch beside light's 1, 3 queued behind them
        scheduler.add_request(f"f{index}", [5, 6, 7], long, tenant="flood")
    scheduler.add_request("light-0", [5, 6, 7], long, tenant="light", tenant_weight=3.0)
    step(scheduler, FakeWorker(4))
    held = {t.tenant: (t.num_running, t.num_waiting) for t in service.report().tenants}
    assert held == {"flood": (7, 3), "light": (1, 0)}
    await RedisPublisher(redis_server.url, "shared:1", service).flush()
    client = redis.Redis.from_url(redis_server.url)
    # Past the watermark: 3 queued, draining 1 a second.
    await client.hset(redis_keys.scheduler_load("shared:1"), mapping={"drain_per_s": 1})
    router = Router(link(redis_server), watermarks=Watermarks(max_queue_ms=1000))
    backends = [backend("shared:1")]

    # light (weight 3 of 4) holds 1 of its 6 slots: 5 more sequences fit, 6 do not.
    light = TenantAsk("light", 3.0, num_sequences=5)
    assert (await router.route(backends, PROMPT, b"", light)).backend.address == "shared:1"
    with pytest.raises(KvmeshError) as over:
        await router.route(backends, PROMPT, b"", TenantAsk("light", 3.0, num_sequences=6))
    assert over.value.reason is Reason.RATE_LIMITED and over.value.retryable
    assert "share is 6 of 8 slots" in over.value.message
    # flood (weight 1 of 4) holds 10, past its 2: refused, naming its own share.
    with pytest.raises(KvmeshError) as flood:
        await router.route(backends, PROMPT, b"", TenantAsk("flood"))
    assert flood.value.reason is Reason.RATE_LIMITED
    assert "'flood'" in flood.value.message and "holds 10 sequence(s)" in flood.value.message
    # A new tenant is below its share (1 of 5): admitted beside both.
    assert await router.route(backends, PROMPT, b"", TenantAsk("new"))
    await client.hset(redis_keys.scheduler_load("shared:1"), mapping={"tenants": "{}"})
    # Alone there (nothing published of other tenants), past the watermark is OVERLOADED.
    with pytest.raises(KvmeshError) as alone:
        await router.route(backends, PROMPT, b"", TenantAsk("flood"))
    assert alone.value.reason is Reason.OVERLOADED
    await client.aclose()


async def test_round_robin_alternates_and_ignores_prefixes(redis_server: RedisServer) -> None:
    router = Router(link(redis_server), policy="round-robin")
    backends = [backend("a:1"), backend("b:2")]
    chosen = [(await router.route(backends, PROMPT, b"")).backend.address for _ in range(4)]
    assert chosen == ["a:1", "b:2", "a:1", "b:2"]


async def test_without_redis_routing_falls_back_to_local_in_flight_counts() -> None:
    dead = RedisServer()  # never started: connections are refused
    router = Router(RedisLink(dead.url, degraded="tests"))
    backends = [backend("a:1"), backend("b:2")]
    backends[0].in_flight = 3
    decision = await router.route(backends, PROMPT, b"")
    assert (decision.backend.address, decision.reason) == ("b:2", "local-fallback")


async def test_publisher_republishes_everything_after_redis_restarts(
    redis_server: RedisServer,
) -> None:
    service = scheduler_service("s:1")
    assert service.loop.scheduler is not None
    service.loop.scheduler.add_request("warm", PROMPT, ONE_TOKEN)
    run_to_completion(service.loop.scheduler, FakeWorker(4))
    publisher = RedisPublisher(redis_server.url, "s:1", service)
    publisher.link.retry_s = 0.0
    await publisher.flush()
    key = redis_keys.prefix_blocks("tiny", b"", "s:1")
    client = redis.Redis.from_url(redis_server.url)
    assert await client.scard(key) == 10
    assert int(await client.pttl(key)) > 0  # a dead scheduler's entries expire
    redis_server.stop()
    await publisher.flush()  # fails quietly: the scheduler serves on
    assert not publisher.link.up
    redis_server.start()  # empty, as after a crash
    await publisher.flush()
    await publisher.flush()
    client = redis.Redis.from_url(redis_server.url)
    assert await client.scard(key) == 10
    load = await client.hgetall(redis_keys.scheduler_load("s:1"))
    assert load[b"ready"] == b"1" and b"queue_ms" in load
    await client.aclose()

"""Which scheduler gets a request, and whether the mesh takes it at all.

Cache-aware routing: the gateway hashes the prompt into the same chained block hashes the
schedulers' prefix caches use (salted per tenant), and asks Redis, in one pipeline, how many
leading blocks each scheduler holds and how loaded each is. Each candidate costs the prompt
tokens already queued there plus twice the prompt tokens it would have to compute (a miss
also evicts cached blocks); the cheapest wins. So a request follows its cached prefix until
that worker's queue is longer than two whole prefills elsewhere. A worker with the mesh's Redis
KV tier can load a prefix that any worker cached (written through): those tokens cost a tenth
of a computed one, so a request goes to the worker whose pool holds its prefix, then to one
that can load it, then to the least loaded.

Admission: a candidate past the queue watermarks is not eligible unless the request's tenant
is below its fair share there (watermarks.py); with none eligible the request is refused at
once, with a RetryInfo of the time the least loaded one needs to drain back under them.

Redis unreachable: requests go to the scheduler with the fewest requests in flight from this
gateway, and admission is left to each scheduler's own bounded queue.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as redis

from services.gateway.config import ROUTING_POLICIES
from services.gateway.mesh.connections import SchedulerBackend
from services.gateway.mesh.watermarks import TenantAsk, Watermarks
from services.gateway.mesh.worker_load import WorkerLoad
from shared import redis_keys
from shared.block_hash import hash_full_blocks
from shared.pb.kvmesh.v1 import inference_pb2
from shared.redis_link import RedisLink
from shared.tenants import Tenant

# A prompt token computed where its prefix is not cached costs its compute, and its blocks
# evict what that worker had cached for later requests: it counts twice against queued work.
MISS_WEIGHT = 2
# A token loaded from the Redis KV tier instead: a 3,000-token prefix loads ~10x faster than it
# prefills on the CPU (make bench-kv-tiers).
LOAD_WEIGHT = 0.1


@dataclass(frozen=True)
class RouteDecision:
    backend: SchedulerBackend
    matched_blocks: int
    block_size: int
    reason: str
    uncached_tokens: int  # what the chosen worker is expected to compute

    def span_attributes(self) -> dict[str, str | int]:
        return {
            "kvmesh.scheduler": self.backend.address,
            "kvmesh.route.reason": self.reason,
            "kvmesh.route.matched_tokens": self.matched_blocks * self.block_size,
        }

    def to_pb(self) -> inference_pb2.RoutingDecision:
        return inference_pb2.RoutingDecision(
            scheduler=self.backend.address,
            matched_blocks=self.matched_blocks,
            matched_tokens=self.matched_blocks * self.block_size,
            reason=self.reason,
        )


@dataclass
class Routed:
    """A request counted against the scheduler it was routed to, until it ends: the load this
    gateway adds there before the scheduler's own report can show it."""

    route: RouteDecision
    tenant: Tenant  # whose sequence it is there
    in_transit: bool = True  # not yet accepted by the scheduler
    pending: bool = True  # no first token yet

    def __post_init__(self) -> None:
        backend = self.route.backend
        backend.in_flight += 1
        backend.in_transit += 1
        backend.pending_tokens += self.route.uncached_tokens
        backend.count_tenant(self.tenant, 1)

    def accepted(self) -> None:
        if self.in_transit:
            self.in_transit = False
            self.route.backend.in_transit -= 1

    def started(self) -> None:
        self.accepted()
        if self.pending:
            self.pending = False
            self.route.backend.pending_tokens -= self.route.uncached_tokens

    def ended(self) -> None:
        self.started()
        backend = self.route.backend
        backend.in_flight -= 1
        backend.count_tenant(self.tenant, -1)


class Router:
    def __init__(
        self,
        link: RedisLink | None,
        policy: str = "cache-aware",
        watermarks: Watermarks | None = None,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, not {policy!r}")
        self.link = link
        self.policy = policy
        self.watermarks = watermarks or Watermarks()
        self._turn = itertools.count()

    async def route(
        self,
        candidates: Sequence[SchedulerBackend],
        token_ids: Sequence[int],
        cache_salt: bytes,
        ask: TenantAsk | None = None,
    ) -> RouteDecision:
        model = candidates[0].served_model()  # the catalog returns ready ones, or raises
        block_size = model.kv_block_size or 1
        # The scheduler always leaves the last prompt token to compute; so does the match here.
        usable_blocks = (len(token_ids) - 1) // block_size
        hashes: list[int] = []
        if self.policy == "cache-aware" and usable_blocks:
            prefix = token_ids[: usable_blocks * block_size]
            hashes = hash_full_blocks(prefix, block_size, cache_salt)
        snapshot = await self._lookup(candidates, model.name, hashes, cache_salt)
        if snapshot is None:
            if self.policy == "round-robin":
                return self._round_robin(candidates, len(token_ids), block_size)
            backend = min(candidates, key=lambda b: b.in_flight)
            return RouteDecision(backend, 0, block_size, "local-fallback", len(token_ids))
        loads, matches = snapshot
        ask = ask or TenantAsk("", prompt_tokens=len(token_ids))
        eligible = [i for i, load in enumerate(loads) if self.watermarks.admits(load, ask)]
        if not eligible:
            raise self.watermarks.refusal(loads, ask)
        if self.policy == "round-robin":
            pool = [candidates[i] for i in eligible]
            return self._round_robin(pool, len(token_ids), block_size)

        best_match = max(matches)

        def cost(index: int) -> tuple[float, int]:
            loadable = best_match - matches[index] if loads[index].shared_tier else 0
            uncached = len(token_ids) - (matches[index] + loadable) * block_size
            work = loads[index].waiting_tokens + MISS_WEIGHT * uncached
            return work + LOAD_WEIGHT * loadable * block_size, candidates[index].in_flight

        chosen = min(eligible, key=cost)
        if matches[chosen] and matches[chosen] == best_match:
            reason = "prefix"
        elif best_match:
            reason = "load"  # a longer prefix sits on a busier worker
        else:
            reason = "least-loaded"
        uncached = len(token_ids) - matches[chosen] * block_size
        return RouteDecision(candidates[chosen], matches[chosen], block_size, reason, uncached)

    def _round_robin(
        self, pool: Sequence[SchedulerBackend], num_tokens: int, block_size: int
    ) -> RouteDecision:
        backend = pool[next(self._turn) % len(pool)]
        return RouteDecision(backend, 0, block_size, "round-robin", num_tokens)

    async def _lookup(
        self,
        candidates: Sequence[SchedulerBackend],
        model_name: str,
        hashes: list[int],
        cache_salt: bytes,
    ) -> tuple[list[WorkerLoad], list[int]] | None:
        """Every candidate's load and leading cached blocks, in one round trip."""
        if self.link is None:
            return None

        async def read(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for backend in candidates:
                pipe.hgetall(redis_keys.scheduler_load(backend.address))
                if hashes:
                    key = redis_keys.prefix_blocks(model_name, cache_salt, backend.address)
                    pipe.smismember(key, hashes)
            return await pipe.execute()

        replies = await self.link.run(read)
        if replies is None:
            return None
        step = 2 if hashes else 1
        loads = [
            WorkerLoad.parse(replies[i * step], backend) for i, backend in enumerate(candidates)
        ]
        matches = [
            _leading_hits(replies[i * step + 1]) if hashes else 0 for i in range(len(candidates))
        ]
        return loads, matches


def _leading_hits(flags: Sequence[int]) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count

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

Admission: a candidate whose estimated queue time or queued tokens is past the watermarks is
not eligible; with none eligible the request is refused at once with OVERLOADED and a
RetryInfo of the time the least loaded one needs to drain back under the watermark.

Redis unreachable: requests go to the scheduler with the fewest requests in flight from this
gateway, and admission is left to each scheduler's own bounded queue.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as redis

from services.gateway.config import ROUTING_POLICIES
from services.gateway.mesh.connections import SchedulerBackend
from shared import redis_keys
from shared.block_hash import hash_full_blocks
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import inference_pb2
from shared.queue_time import queue_time_s
from shared.redis_link import RedisLink

# A prompt token computed where its prefix is not cached costs its compute, and its blocks
# evict what that worker had cached for later requests: it counts twice against queued work.
MISS_WEIGHT = 2
# A token loaded from the Redis KV tier instead: a 3,000-token prefix loads ~10x faster than it
# prefills on the CPU (make bench-kv-tiers).
LOAD_WEIGHT = 0.1
MIN_RETRY_MS = 100
MAX_RETRY_MS = 60_000


@dataclass(frozen=True)
class Watermarks:
    max_queue_ms: float = 0.0  # 0: no limit
    max_queue_tokens: int = 0


@dataclass(frozen=True)
class WorkerLoad:
    """One scheduler's load as it last published it, corrected by what this gateway has sent
    it since (its report can be a few steps old)."""

    waiting: int  # queued there, plus sent from here and not yet accepted
    free_slots: int
    max_running: int
    in_flight_here: int  # this gateway's requests there: running or queued, never stale
    waiting_tokens: int  # prefill work queued there (or sent from here and not yet started)
    drain_per_s: float
    published: bool  # False: no fresh report in Redis
    shared_tier: bool = False  # its worker loads from the mesh's Redis KV tier
    slot_releases_s: tuple[float, ...] = ()  # when its running requests free their slots

    @classmethod
    def parse(cls, fields: dict[bytes, bytes] | None, backend: SchedulerBackend) -> WorkerLoad:
        fields = fields or {}
        tokens = int(fields.get(b"waiting_tokens", 0))
        return cls(
            waiting=int(fields.get(b"waiting", 0)) + backend.in_transit,
            free_slots=int(fields.get(b"max_running", 0)) - int(fields.get(b"running", 0)),
            max_running=int(fields.get(b"max_running", 0)),
            in_flight_here=backend.in_flight,
            waiting_tokens=max(tokens, backend.pending_tokens),
            drain_per_s=float(fields.get(b"drain_per_s", 0.0)),
            published=bool(fields),
            shared_tier=fields.get(b"kv_shared_tier") == b"1",
            slot_releases_s=tuple(
                float(s) for s in fields.get(b"slot_releases_s", b"").split(b",") if s
            ),
        )

    @property
    def queue_ms(self) -> float:
        if not self.published:
            return 0.0  # unknown: left to the scheduler's own bounded queue
        # Two lower bounds of the queue beyond the free slots: the published one (complete, but
        # a few steps old) and this gateway's own (current, but blind to other gateways).
        releases = self.slot_releases_s
        published = queue_time_s(self.waiting, self.free_slots, self.drain_per_s, releases)
        here = queue_time_s(self.in_flight_here, self.max_running, self.drain_per_s, releases)
        return max(published, here) * 1e3


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
    in_transit: bool = True  # not yet accepted by the scheduler
    pending: bool = True  # no first token yet

    def __post_init__(self) -> None:
        backend = self.route.backend
        backend.in_flight += 1
        backend.in_transit += 1
        backend.pending_tokens += self.route.uncached_tokens

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
        self.route.backend.in_flight -= 1


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
        eligible = [i for i, load in enumerate(loads) if self._admits(load)]
        if not eligible:
            raise self._overloaded(loads)
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

    def _admits(self, load: WorkerLoad) -> bool:
        marks = self.watermarks
        if marks.max_queue_ms and load.queue_ms > marks.max_queue_ms:
            return False
        return not (marks.max_queue_tokens and load.waiting_tokens > marks.max_queue_tokens)

    def _overloaded(self, loads: list[WorkerLoad]) -> KvmeshError:
        marks = self.watermarks
        waits = []
        for load in loads:
            drain_ms = 0.0
            if marks.max_queue_ms and load.queue_ms > marks.max_queue_ms:
                drain_ms = load.queue_ms - marks.max_queue_ms
            if marks.max_queue_tokens and load.waiting_tokens > marks.max_queue_tokens:
                excess = load.waiting_tokens - marks.max_queue_tokens
                per_token_ms = load.queue_ms / max(load.waiting_tokens, 1)
                drain_ms = max(drain_ms, excess * per_token_ms)
            waits.append(drain_ms)
        retry_ms = min(waits)
        retry_ms = MAX_RETRY_MS if math.isinf(retry_ms) else retry_ms
        return KvmeshError(
            Reason.OVERLOADED,
            f"every scheduler is past the admission watermarks "
            f"(queue estimates {', '.join(f'{load.queue_ms:.0f} ms' for load in loads)})",
            retryable=True,
            retry_after_ms=int(min(MAX_RETRY_MS, max(MIN_RETRY_MS, retry_ms))),
        )


def _leading_hits(flags: Sequence[int]) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count

"""The scheduler's side of the step stream to its engine-worker.

`connect()` waits until the worker is ready and opens the long-lived Step stream; `step()` is
one message out and one back. A watcher on the worker's health notices a lost worker even while
no step is in flight, so readiness drops at once and a pending step fails instead of hanging.
A worker that turns NOT_SERVING while still reachable is draining (SIGTERM): the scheduler takes
no new requests, finishes the ones it has, then lets go of the Step stream so the worker exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scheduler.tier_loads import NO_TIERS, TierPolicy
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, engine_worker_pb2, engine_worker_pb2_grpc
from shared.runtime.service import CHANNEL_OPTIONS
from shared.runtime.tls import aio_channel

log = logging.getLogger("kvmesh.scheduler.worker_link")
_SERVING = health_pb2.HealthCheckResponse.SERVING
PREPARE_TIMEOUT_S = 30.0  # a grammar compile; schemas take milliseconds
# A tier lookup is in-memory indexes and one Redis round trip; past this the request simply
# computes its prompt (never waits on a slow tier).
LOOKUP_TIMEOUT_S = 0.5


class WorkerLost(Exception):
    pass


class WorkerDrained(Exception):
    """The draining worker has nothing left of ours: time to let go of it."""


class WorkerLink:
    def __init__(self, address: str, on_lost: Callable[[], None]) -> None:
        self.address = address
        self._on_lost = on_lost  # wakes the step loop so it notices while idle
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.lost = False
        self.tiers = NO_TIERS  # the attached worker's KV tiers (WorkerInfo)
        self.draining = False  # reachable but NOT_SERVING: finish what runs, take nothing new
        self.fail_handovers = False  # --kv-load-failure fail (the scheduler plans with it)

    async def connect(self) -> common_pb2.ModelInfo:
        """Blocks until the worker serves; retries forever (a worker may take minutes to load)."""
        while True:
            self._channel = aio_channel(self.address, options=CHANNEL_OPTIONS)
            stub = engine_worker_pb2_grpc.EngineWorkerStub(self._channel)
            try:
                await self._wait_serving(self._channel)
                info = await stub.GetInfo(engine_worker_pb2.WorkerInfoRequest(), timeout=10)
                self._call = stub.Step()
                self.lost = self.draining = False
                kv = info.kv_tiers
                self.tiers = TierPolicy(
                    tuple(kv.tiers), kv.write or "through", kv.load_min_tokens, self.fail_handovers
                )
                self._watcher = asyncio.create_task(self._watch(self._channel))
                log.info("worker attached", extra={"worker": self.address})
                return info.model
            except grpc.RpcError as error:
                log.info("worker not ready", extra={"worker": self.address, "error": str(error)})
                await self.close()
                await asyncio.sleep(0.5)

    async def prepare_format(
        self, response_format: common_pb2.ResponseFormat, timeout: float | None
    ) -> None:
        """The worker compiles the format before the request queues (never on a step);
        INVALID_SCHEMA when it cannot."""
        if self._channel is None or self.lost:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                "no engine-worker attached yet",
                retryable=True,
                retry_after_ms=1000,
            )
        stub = engine_worker_pb2_grpc.EngineWorkerStub(self._channel)
        try:
            await stub.PrepareFormat(response_format, timeout=timeout or PREPARE_TIMEOUT_S)
        except grpc.RpcError as error:
            raise grpc_errors.from_rpc_error(error) from None

    async def lookup_blocks(self, block_hashes: list[int]) -> int:
        """How many of a prompt's leading blocks the worker's tiers hold; 0 on any failure."""
        if self._channel is None or self.lost or not block_hashes:
            return 0
        stub = engine_worker_pb2_grpc.EngineWorkerStub(self._channel)
        lookup = engine_worker_pb2.BlockLookup(block_hashes=block_hashes)
        try:
            found = await stub.LookupBlocks(lookup, timeout=LOOKUP_TIMEOUT_S)
        except grpc.RpcError as error:
            log.info("kv tier lookup failed", extra={"error": str(error.code())})
            return 0
        return int(found.num_leading)

    async def pull_blocks(
        self, source: str, lease_id: str, block_hashes: list[int], timeout_s: float
    ) -> engine_worker_pb2.PullResult:
        """The worker pulls a handed-over request's blocks from `source`; what arrived."""
        if self._channel is None or self.lost:
            return engine_worker_pb2.PullResult(outcome="worker_lost")
        stub = engine_worker_pb2_grpc.EngineWorkerStub(self._channel)
        pull = engine_worker_pb2.PullRequest(
            source_worker=source, lease_id=lease_id, block_hashes=block_hashes, timeout_s=timeout_s
        )
        try:  # the worker bounds the pull itself; this bound is for the worker going away
            return await stub.PullBlocks(pull, timeout=timeout_s + 5)
        except grpc.RpcError as error:
            log.info("kv handover pull failed", extra={"error": str(error.code())})
            return engine_worker_pb2.PullResult(outcome="error")

    @staticmethod
    async def _wait_serving(channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        async for reply in health.Watch(request, wait_for_ready=True):
            if reply.status == _SERVING:
                return

    async def _watch(self, channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        try:
            async for reply in health.Watch(health_pb2.HealthCheckRequest(service="")):
                if reply.status != _SERVING and not self.draining:
                    log.warning("worker draining", extra={"worker": self.address})
                    self.draining = True
                    self._on_lost()  # wakes the step loop: it may have nothing left to do
        except grpc.RpcError:
            pass
        except asyncio.CancelledError:
            return
        log.warning("worker lost", extra={"worker": self.address})
        self.lost = True
        if self._call is not None:
            self._call.cancel()
        self._on_lost()

    async def step(self, plan: engine_worker_pb2.StepPlan) -> engine_worker_pb2.StepResult:
        await self.send(plan)
        return await self.receive()

    async def send(self, plan: engine_worker_pb2.StepPlan) -> None:
        """One plan onto the stream; the worker runs plans in the order sent."""
        if self._call is None or self.lost:
            raise WorkerLost(self.address)
        async with self._stream_errors():
            await self._call.write(plan)

    async def receive(self) -> engine_worker_pb2.StepResult:
        """The result of the oldest plan sent whose result was not read yet."""
        if self._call is None or self.lost:
            raise WorkerLost(self.address)
        async with self._stream_errors():
            result = await self._call.read()
        if result is grpc.aio.EOF:
            raise WorkerLost(f"{self.address}: step stream closed")
        return result

    @contextlib.asynccontextmanager
    async def _stream_errors(self) -> AsyncIterator[None]:
        try:
            yield
        except (grpc.RpcError, asyncio.InvalidStateError) as error:
            raise WorkerLost(f"{self.address}: {error}") from error
        except asyncio.CancelledError:
            if self.lost:  # the watcher cancelled the call, not someone cancelling us
                raise WorkerLost(f"{self.address}: health watch ended") from None
            raise

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def worker_lost_error(*, emitted_tokens: bool) -> KvmeshError:
    """Retryable only before the first token: a resent request that already streamed tokens
    would show its client those tokens twice (or, sampled, different ones). The message names
    no address: the scheduler's log has it."""
    return KvmeshError(
        Reason.WORKER_LOST,
        "the engine-worker computing this request stopped responding",
        retryable=not emitted_tokens,
        retry_after_ms=0 if emitted_tokens else 1000,
    )

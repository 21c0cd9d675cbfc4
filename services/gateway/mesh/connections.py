"""The gateway's connections to what serves models: schedulers (Generate) and embedding workers
(Embed), each watched over a health stream (no polling), each knowing the model it serves."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import ClassVar, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.mesh.submit_lanes import SubmitLanes
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import (
    common_pb2,
    engine_worker_pb2,
    engine_worker_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from shared.runtime.service import CHANNEL_OPTIONS
from shared.runtime.tls import aio_channel
from shared.tenants import Tenant

log = logging.getLogger("kvmesh.gateway.connections")
SERVING = health_pb2.HealthCheckResponse.SERVING
RECONNECT_PAUSE_S = 0.2


async def watch_health(
    channel: grpc.aio.Channel, on_status: Callable[[bool], Awaitable[None]], what: str
) -> None:
    """Calls `on_status(serving)` on every health change of the peer behind `channel`, and
    `on_status(False)` each time the stream breaks; reconnects forever."""
    health = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="")
    while True:
        try:
            async for reply in health.Watch(request, wait_for_ready=True):
                await on_status(reply.status == SERVING)
        except grpc.RpcError as error:
            log.info("unreachable", extra={"peer": what, "error": str(error.code())})
        await on_status(False)
        await asyncio.sleep(RECONNECT_PAUSE_S)


class ModelBackend:
    """A peer serving one model version: ready while its health says SERVING."""

    task: ClassVar[str]  # "generate" or "embed": which public call it serves

    def __init__(self, address: str, declared_name: str = "", declared_version: str = "") -> None:
        self.address = address
        self.channel = aio_channel(address, options=CHANNEL_OPTIONS)
        self.model: common_pb2.ModelInfo | None = None  # set while ready
        # What it was added to serve: known (for MODEL_NOT_READY) before it is ready.
        self.declared_name = declared_name
        self.declared_version = declared_version
        self.retired = False  # removed: no new requests, its streams finish
        self.in_flight = 0  # streams this gateway has open there (a removal waits for them)
        # The model (name, version) it served last: a backend down now is not "loading".
        self.last_served: tuple[str, str] | None = None

    @classmethod
    def from_spec(cls, spec: str) -> Self:
        """`HOST:PORT`, or `NAME[@VERSION]=HOST:PORT` for one that serves a known model."""
        model, sep, address = spec.rpartition("=")
        name, _, version = model.partition("@")
        return cls(address, name, version) if sep else cls(spec)

    @property
    def name(self) -> str:
        return self.model.name if self.model is not None else self.declared_name

    @property
    def version(self) -> str:
        return self.model.version if self.model is not None else self.declared_version

    @property
    def ready(self) -> bool:
        return self.model is not None and not self.retired

    def served_model(self) -> common_pb2.ModelInfo:
        """The model it serves; a backend whose health turned since it was chosen is not
        ready (retryable), never an `AttributeError` on None."""
        if self.model is None:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                f"{self.address} stopped serving its model",
                retryable=True,
                retry_after_ms=1000,
            )
        return self.model

    async def watch(self, on_change: Callable[[], Awaitable[None]]) -> None:
        async def on_status(serving: bool) -> None:
            was = self.model
            self.model = await self.fetch_model() if serving else None
            if self.model is not None:
                self.last_served = (self.model.name, self.model.version)
            if serving or was is not None:
                await on_change()

        await watch_health(self.channel, on_status, f"{self.task} {self.address}")

    async def fetch_model(self) -> common_pb2.ModelInfo:
        raise NotImplementedError

    async def close(self) -> None:
        await self.channel.close()


class SchedulerBackend(ModelBackend):
    """A scheduler (and the engine-worker behind it): where Generate requests go."""

    task = "generate"

    def __init__(self, address: str, declared_name: str = "", declared_version: str = "") -> None:
        super().__init__(address, declared_name, declared_version)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.lanes = SubmitLanes(self.stub)  # every request's events on one stream
        # Requests this gateway routed here until the scheduler accepted them (its published
        # load cannot count them yet); and the prompt tokens of those without a first token,
        # the prefill work they bring (fresher than the published load).
        self.in_transit = 0
        self.pending_tokens = 0
        # Sequences this gateway has here per tenant, and their weights: a current lower bound
        # of the tenant holds the scheduler publishes.
        self.tenant_sequences: collections.Counter[str] = collections.Counter()
        self.tenant_weights: dict[str, float] = {}

    def count_tenant(self, tenant: Tenant, sequences: int) -> None:
        name = tenant.name
        self.tenant_weights[name] = tenant.weight
        self.tenant_sequences[name] += sequences
        if self.tenant_sequences[name] <= 0:
            del self.tenant_sequences[name], self.tenant_weights[name]

    async def fetch_model(self) -> common_pb2.ModelInfo:
        return await self.stub.GetModel(scheduler_pb2.SchedulerModelRequest(), timeout=5)

    async def close(self) -> None:
        await self.lanes.aclose()
        await super().close()


class EmbedderBackend(ModelBackend):
    """An engine-worker serving an embedding model: Embed calls go to it directly (it batches
    them itself; there is no KV cache to schedule)."""

    task = "embed"

    def __init__(self, address: str, declared_name: str = "", declared_version: str = "") -> None:
        super().__init__(address, declared_name, declared_version)
        self.embedder = engine_worker_pb2_grpc.EmbedderStub(self.channel)

    async def fetch_model(self) -> common_pb2.ModelInfo:
        return await self.embedder.GetModel(engine_worker_pb2.EmbedderModelRequest(), timeout=5)

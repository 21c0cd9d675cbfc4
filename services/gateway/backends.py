"""The gateway's view of the mesh: the tokenizer and the schedulers, and which are ready.

Each scheduler's health is watched over a stream (no polling); the gateway is ready while at
least one scheduler is. Which of them gets a request is the router's choice (router.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2_grpc,
)
from shared.service import CHANNEL_OPTIONS
from shared.tls import aio_channel

if TYPE_CHECKING:
    from services.gateway.router import RouteDecision

log = logging.getLogger("kvmesh.gateway.backends")
_SERVING = health_pb2.HealthCheckResponse.SERVING


class SchedulerBackend:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = aio_channel(address, options=CHANNEL_OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.model: common_pb2.ModelInfo | None = None  # set while ready
        # Requests this gateway routed here: until they end; until the scheduler accepted them
        # (so its published load cannot count them yet); and the prompt tokens of those without
        # a first token, the prefill work they bring (fresher than the published load).
        self.in_flight = 0
        self.in_transit = 0
        self.pending_tokens = 0

    @property
    def ready(self) -> bool:
        return self.model is not None

    async def watch(self, on_change: Callable[[], Awaitable[None]]) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                async for reply in health.Watch(request, wait_for_ready=True):
                    if reply.status == _SERVING:
                        self.model = await self.stub.GetModel(
                            scheduler_pb2.SchedulerModelRequest(), timeout=5
                        )
                    else:
                        self.model = None
                    await on_change()
            except grpc.RpcError as error:
                log.info(
                    "scheduler unreachable",
                    extra={"scheduler": self.address, "error": str(error.code())},
                )
            if self.model is not None:
                self.model = None
                await on_change()
            await asyncio.sleep(0.2)


@dataclass
class Routed:
    """A request counted against the scheduler it was routed to, until it ends."""

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


class Backends:
    def __init__(self, tokenizer_address: str, scheduler_addresses: list[str]) -> None:
        self.tokenizer_channel = aio_channel(tokenizer_address, options=CHANNEL_OPTIONS)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.tokenizer_channel)
        self.tokenizer_ready = False
        self.schedulers = [SchedulerBackend(a) for a in scheduler_addresses]
        self._watchers: list[asyncio.Task[None]] = []

    def start(self, on_change: Callable[[bool], Awaitable[None]]) -> None:
        async def changed() -> None:
            await on_change(self.tokenizer_ready and any(s.ready for s in self.schedulers))

        self._watchers = [asyncio.create_task(s.watch(changed)) for s in self.schedulers]
        self._watchers.append(asyncio.create_task(self._watch_tokenizer(changed)))

    async def _watch_tokenizer(self, on_change: Callable[[], Awaitable[None]]) -> None:
        """Every request needs the tokenizer (text in, text out): without it, refuse at once
        rather than accept a stream that cannot show a token."""
        health = health_pb2_grpc.HealthStub(self.tokenizer_channel)
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                async for reply in health.Watch(request, wait_for_ready=True):
                    self.tokenizer_ready = reply.status == _SERVING
                    await on_change()
            except grpc.RpcError as error:
                log.info("tokenizer unreachable", extra={"error": str(error.code())})
            if self.tokenizer_ready:
                self.tokenizer_ready = False
                await on_change()
            await asyncio.sleep(0.2)

    def require_tokenizer(self) -> None:
        if not self.tokenizer_ready:
            raise KvmeshError(
                Reason.TOKENIZER_LOST,
                "the tokenizer service is not serving",
                retryable=True,
                retry_after_ms=1000,
            )

    def serving(self, model_name: str) -> list[SchedulerBackend]:
        """The ready schedulers serving `model_name` (empty name: any), or a clear error."""
        ready = [s for s in self.schedulers if s.ready]
        if not ready:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                "no scheduler with a loaded model is reachable yet",
                retryable=True,
                retry_after_ms=1000,
            )
        serving = [s for s in ready if not model_name or (s.model and s.model.name == model_name)]
        if not serving:
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND,
                f"no model named {model_name!r}; ListModels shows what is served",
            )
        return serving

    def pick(self, model_name: str) -> SchedulerBackend:
        """Any scheduler serving the model, for questions about the model (not requests)."""
        return self.serving(model_name)[0]

    def model_info(self, name: str) -> common_pb2.ModelInfo | None:
        """A served model's info by name; None once no ready scheduler serves it."""
        return next((m for m in self.models() if m.name == name), None)

    def models(self) -> list[common_pb2.ModelInfo]:
        seen: dict[str, common_pb2.ModelInfo] = {}
        for scheduler in self.schedulers:
            if scheduler.model is not None:
                seen.setdefault(scheduler.model.name, scheduler.model)
        return list(seen.values())

    async def close(self) -> None:
        for watcher in self._watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for scheduler in self.schedulers:
            await scheduler.channel.close()
        await self.tokenizer_channel.close()

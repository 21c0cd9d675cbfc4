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
from typing import TYPE_CHECKING, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.discovery import DnsDiscovery, is_dns_spec
from services.gateway.traffic import TrafficSplit
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import (
    common_pb2,
    engine_worker_pb2,
    engine_worker_pb2_grpc,
    inference_pb2,
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
    """A scheduler (and the engine-worker behind it): where Generate requests go."""

    task = "generate"

    def __init__(self, address: str, declared_name: str = "", declared_version: str = "") -> None:
        self.address = address
        self.channel = aio_channel(address, options=CHANNEL_OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.model: common_pb2.ModelInfo | None = None  # set while ready
        # What it was added to serve: known (for MODEL_NOT_READY) before it is ready.
        self.declared_name = declared_name
        self.declared_version = declared_version
        self.retired = False  # removed: no new requests, its streams finish
        # Requests this gateway routed here: until they end; until the scheduler accepted them
        # (so its published load cannot count them yet); and the prompt tokens of those without
        # a first token, the prefill work they bring (fresher than the published load).
        self.in_flight = 0
        self.in_transit = 0
        self.pending_tokens = 0

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

    async def watch(self, on_change: Callable[[], Awaitable[None]]) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                async for reply in health.Watch(request, wait_for_ready=True):
                    if reply.status == _SERVING:
                        self.model = await self._fetch_model()
                    else:
                        self.model = None
                    await on_change()
            except grpc.RpcError as error:
                log.info(
                    "backend unreachable",
                    extra={"backend": self.address, "task": self.task, "error": str(error.code())},
                )
            if self.model is not None:
                self.model = None
                await on_change()
            await asyncio.sleep(0.2)

    async def _fetch_model(self) -> common_pb2.ModelInfo:
        return await self.stub.GetModel(scheduler_pb2.SchedulerModelRequest(), timeout=5)


class EmbedderBackend(SchedulerBackend):
    """An engine-worker serving an embedding model: Embed calls go to it directly (it batches
    them itself; there is no KV cache to schedule)."""

    task = "embed"

    def __init__(self, address: str, declared_name: str = "", declared_version: str = "") -> None:
        super().__init__(address, declared_name, declared_version)
        self.embedder = engine_worker_pb2_grpc.EmbedderStub(self.channel)

    async def _fetch_model(self) -> common_pb2.ModelInfo:
        request = engine_worker_pb2.EmbedderModelRequest()
        return await self.embedder.GetModel(request, timeout=5)


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
    def __init__(
        self,
        tokenizer_address: str,
        scheduler_specs: list[str],
        default_model: str = "",
        embedder_specs: list[str] | None = None,
    ) -> None:
        self.tokenizer_channel = aio_channel(tokenizer_address, options=CHANNEL_OPTIONS)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.tokenizer_channel)
        self.tokenizer_ready = False
        # Generation schedulers and embedding workers, told apart by `task`.
        static = [spec for spec in scheduler_specs if not is_dns_spec(spec)]
        self.schedulers: list[SchedulerBackend] = [SchedulerBackend.from_spec(s) for s in static]
        # dns:///HOST:PORT specs: schedulers added and removed as the name resolves.
        self.discoveries = [
            DnsDiscovery(self, spec) for spec in scheduler_specs if is_dns_spec(spec)
        ]
        self.schedulers += [EmbedderBackend.from_spec(spec) for spec in embedder_specs or []]
        self.default_model = default_model  # "": the first scheduler's model
        self.traffic = TrafficSplit()
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._on_change: Callable[[bool, dict[str, bool]], Awaitable[None]] | None = None

    def start(self, on_change: Callable[[bool, dict[str, bool]], Awaitable[None]]) -> None:
        """`on_change(ready, per-model readiness)` after every change of either."""
        self._on_change = on_change
        for scheduler in self.schedulers:
            self._watch(scheduler)
        self._watchers[""] = asyncio.create_task(self._watch_tokenizer(self.notify))
        for index, discovery in enumerate(self.discoveries):
            self._watchers[f"dns-{index}"] = asyncio.create_task(discovery.run())

    def _watch(self, scheduler: SchedulerBackend) -> None:
        self._watchers[scheduler.address] = asyncio.create_task(scheduler.watch(self.notify))

    async def notify(self) -> None:
        """Tell `on_change` the current readiness (after any change, including traffic)."""
        if self._on_change is not None:
            ready = self.tokenizer_ready and any(s.ready for s in self.schedulers)
            await self._on_change(ready, self.model_readiness())

    def model_readiness(self) -> dict[str, bool]:
        """Health service names: each model, and each model@version, SERVING while a ready
        backend serves it (and, for generation, the tokenizer is up: embedding workers
        tokenize themselves)."""
        readiness: dict[str, bool] = {}
        for scheduler in self.schedulers:
            if scheduler.retired or not scheduler.name:
                continue
            ready = scheduler.ready and (self.tokenizer_ready or scheduler.task == "embed")
            for name in (scheduler.name, f"{scheduler.name}@{scheduler.version}"):
                readiness[name] = readiness.get(name, False) or ready
        return readiness

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

    async def add(self, address: str, name: str, version: str, task: str = "generate") -> None:
        """Route to this scheduler (or embedding worker) for name@version once it is ready."""
        known = self._find(address)
        if known is not None:
            known.declared_name, known.declared_version = name, version
            known.retired = False
        else:
            kind = EmbedderBackend if task == "embed" else SchedulerBackend
            scheduler = kind(address, name, version)
            self.schedulers.append(scheduler)
            if self._on_change is not None:
                self._watch(scheduler)
        log.info("scheduler added", extra={"scheduler": address, "model": f"{name}@{version}"})
        await self.notify()

    async def remove(self, address: str, drain_timeout_s: float) -> int:
        """No new requests to it; once its streams through here ended (or the timeout passed),
        let go of it. Returns the streams still open then."""
        scheduler = self._find(address)
        if scheduler is None:
            return 0
        scheduler.retired = True
        await self.notify()
        deadline = asyncio.get_running_loop().time() + drain_timeout_s
        while scheduler.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        left = scheduler.in_flight
        if scheduler.retired and left == 0:  # not re-added meanwhile
            self.schedulers.remove(scheduler)
            watcher = self._watchers.pop(address, None)
            if watcher is not None:
                watcher.cancel()
            await scheduler.channel.close()
            await self.notify()
        log.info("scheduler removed", extra={"scheduler": address, "streams_left": left})
        return left

    def _find(self, address: str) -> SchedulerBackend | None:
        return next((s for s in self.schedulers if s.address == address), None)

    def _canonical(self, name: str, task: str = "generate") -> str:
        """An alias to its model's name; "" to the task's default model."""
        if not name:
            if self.default_model and task == "generate":
                return self.default_model
            live = (s for s in self.schedulers if s.name and not s.retired and s.task == task)
            declared = (d.name for d in self.discoveries if task == "generate")
            return next((s.name for s in live), next(declared, ""))
        for scheduler in self.schedulers:
            if scheduler.model is not None and name in scheduler.model.aliases:
                return scheduler.model.name
        return name

    def serving(
        self, model: str, split: bool = True, task: str = "generate"
    ) -> list[SchedulerBackend]:
        """The ready backends for a request's `model` (NAME, NAME@VERSION, an alias, or ""):
        one version's, chosen by the model's traffic split unless pinned (or `split` is off:
        questions about the model take no turn in it); or a clear error."""
        requested_name, _, version = model.partition("@")
        name = self._canonical(requested_name, task)
        other = [s for s in self.schedulers if s.name == name and s.task != task]
        if other and not any(s.task == task and s.name == name for s in self.schedulers):
            use = "Embed (/v1/embeddings)" if other[0].task == "embed" else "Generate"
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, f"model {name!r} is for {other[0].task}: use {use}"
            )
        live = [s for s in self.schedulers if not s.retired and s.task == task]
        known = [s for s in live if s.name == name and (not version or s.version == version)]
        ready = [s for s in known if s.ready]
        if not ready:
            # A scheduler not ready yet (or not yet resolved from DNS) may turn out to serve it:
            # not ready rather than unknown.
            discovering = any(d.name in ("", name) for d in self.discoveries)
            if known or not name or discovering or any(not s.name for s in live):
                what = f"model {model!r}" if model else "the default model"
                raise KvmeshError(
                    Reason.MODEL_NOT_READY,
                    f"{what} is loading: no scheduler serving it is ready yet",
                    retryable=True,
                    retry_after_ms=1000,
                )
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND,
                f"no model named {model!r}; ListModels shows what is served",
            )
        if split and not version:
            chosen = self.traffic.choose(name, {s.version for s in ready})
            if chosen is not None:
                ready = [s for s in ready if s.version == chosen]
        return ready

    def pick(self, model_name: str) -> SchedulerBackend:
        """A scheduler serving the model, for questions about the model (not requests): of
        the version with the largest traffic share. Embedding models count too."""
        task = "generate"
        name = self._canonical(model_name.partition("@")[0])
        if any(s.name == name and s.task == "embed" for s in self.schedulers):
            task = "embed"
        ready = self.serving(model_name, split=False, task=task)
        shares = self.traffic.percent(ready[0].name)
        return max(ready, key=lambda scheduler: shares.get(scheduler.version, 0.0))

    def models(self) -> list[common_pb2.ModelInfo]:
        """One per ready model version, the default model first."""
        seen: dict[tuple[str, str], common_pb2.ModelInfo] = {}
        for scheduler in self.schedulers:
            if scheduler.ready and scheduler.model is not None:
                seen.setdefault((scheduler.name, scheduler.version), scheduler.model)
        default = self._canonical("")
        return sorted(seen.values(), key=lambda m: m.name != default)

    def versions(self) -> list[inference_pb2.ModelVersionStatus]:
        statuses: dict[tuple[str, str], inference_pb2.ModelVersionStatus] = {}
        for scheduler in self.schedulers:
            if not scheduler.name:
                continue
            key = (scheduler.name, scheduler.version)
            status = statuses.setdefault(
                key, inference_pb2.ModelVersionStatus(name=key[0], version=key[1])
            )
            if not scheduler.retired:
                status.replicas += 1
                status.ready_replicas += scheduler.ready
        for (name, version), status in statuses.items():
            if not status.replicas:
                status.state = "draining"
            else:
                status.state = "ready" if status.ready_replicas else "loading"
            split = self.traffic.percent(name)
            if split:
                status.traffic_percent = split.get(version, 0.0)
            elif status.ready_replicas:
                ready_for_name = sum(
                    s.ready_replicas for (n, _), s in statuses.items() if n == name
                )
                status.traffic_percent = 100.0 * status.ready_replicas / ready_for_name
        return list(statuses.values())

    async def close(self) -> None:
        for discovery in self.discoveries:
            await discovery.close()
        for watcher in list(self._watchers.values()):
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for scheduler in self.schedulers:
            await scheduler.channel.close()
        await self.tokenizer_channel.close()

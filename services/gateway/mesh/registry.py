"""Which schedulers and embedding workers this gateway knows, and which of them are ready.

Backends come from flags (static addresses), from DNS (discovery.py adds and removes them) and
from the ModelAdmin API. Each is watched over its health stream; the gateway is ready while the
tokenizer and at least one backend are. Which backend serves a request is the catalog's and the
router's choice, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

from services.gateway.mesh.connections import EmbedderBackend, ModelBackend, SchedulerBackend
from services.gateway.mesh.discovery import DnsDiscovery, is_dns_spec
from services.gateway.mesh.tokenizer_link import TokenizerLink

log = logging.getLogger("kvmesh.gateway.registry")
ReadinessCallback = Callable[[bool, dict[str, bool]], Awaitable[None]]


class BackendRegistry:
    def __init__(
        self,
        tokenizer: TokenizerLink,
        scheduler_specs: list[str],
        embedder_specs: list[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        static = [spec for spec in scheduler_specs if not is_dns_spec(spec)]
        self.schedulers = [SchedulerBackend.from_spec(spec) for spec in static]
        self.embedders = [EmbedderBackend.from_spec(spec) for spec in embedder_specs or []]
        # dns:///HOST:PORT specs: schedulers added and removed as the name resolves.
        self.discoveries = [
            DnsDiscovery(self, spec) for spec in scheduler_specs if is_dns_spec(spec)
        ]
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._on_change: ReadinessCallback | None = None

    def all(self) -> Iterator[ModelBackend]:
        yield from self.schedulers
        yield from self.embedders

    @property
    def ready(self) -> bool:
        return self.tokenizer.ready and any(backend.ready for backend in self.all())

    def start(self, on_change: ReadinessCallback) -> None:
        """`on_change(ready, per-model readiness)` after every change of either."""
        self._on_change = on_change
        for backend in self.all():
            self._watch(backend)
        self._watchers[""] = asyncio.create_task(self.tokenizer.watch(self.notify))
        for index, discovery in enumerate(self.discoveries):
            self._watchers[f"dns-{index}"] = asyncio.create_task(discovery.run())

    def _watch(self, backend: ModelBackend) -> None:
        self._watchers[backend.address] = asyncio.create_task(backend.watch(self.notify))

    async def notify(self) -> None:
        """Tell `on_change` the current readiness (after any change, including traffic)."""
        if self._on_change is not None:
            await self._on_change(self.ready, self.model_readiness())

    def model_readiness(self) -> dict[str, bool]:
        """Health service names: each model, and each model@version, SERVING while a ready
        backend serves it (and, for generation, the tokenizer is up: embedding workers
        tokenize themselves)."""
        readiness: dict[str, bool] = {}
        for backend in self.all():
            if backend.retired or not backend.name:
                continue
            ready = backend.ready and (self.tokenizer.ready or backend.task == "embed")
            for name in (backend.name, f"{backend.name}@{backend.version}"):
                readiness[name] = readiness.get(name, False) or ready
        return readiness

    def find(self, address: str) -> ModelBackend | None:
        return next((b for b in self.all() if b.address == address), None)

    async def add(self, address: str, name: str, version: str, task: str = "generate") -> None:
        """Route to this scheduler (or embedding worker) for name@version once it is ready."""
        known = self.find(address)
        if known is not None:
            known.declared_name, known.declared_version = name, version
            known.retired = False
        else:
            backend: ModelBackend
            if task == "embed":
                backend = EmbedderBackend(address, name, version)
                self.embedders.append(backend)
            else:
                backend = SchedulerBackend(address, name, version)
                self.schedulers.append(backend)
            if self._on_change is not None:
                self._watch(backend)
        log.info("backend added", extra={"backend": address, "model": f"{name}@{version}"})
        await self.notify()

    async def remove(self, address: str, drain_timeout_s: float) -> int:
        """No new requests to it; once its streams through here ended (or the timeout passed),
        let go of it. Returns the streams still open then."""
        backend = self.find(address)
        if backend is None:
            return 0
        backend.retired = True
        await self.notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while backend.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = backend.in_flight
        if backend.retired and left == 0:  # not re-added meanwhile
            if isinstance(backend, SchedulerBackend):
                self.schedulers.remove(backend)
            elif isinstance(backend, EmbedderBackend):
                self.embedders.remove(backend)
            watcher = self._watchers.pop(address, None)
            if watcher is not None:
                watcher.cancel()
            await backend.close()
            await self.notify()
        log.info("backend removed", extra={"backend": address, "streams_left": left})
        return left

    async def close(self) -> None:
        for discovery in self.discoveries:
            await discovery.close()
        for watcher in list(self._watchers.values()):
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for backend in self.all():
            await backend.close()
        await self.tokenizer.close()

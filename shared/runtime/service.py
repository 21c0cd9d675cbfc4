"""What every service process shares: a gRPC aio server with health and reflection, flags from
the environment, and a SIGTERM drain.

Health: service "liveness" is SERVING while the process runs; "" and the service's own name
turn SERVING only when it can serve (model loaded and warmed, a ready peer reachable).
SIGTERM (or SIGINT): readiness goes NOT_SERVING, new work is refused, in-flight streams get a
grace period to finish, then the server stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.errors import KvmeshError, Reason
from shared.runtime.error_boundary import KvmeshErrors
from shared.runtime.heap import freeze_startup_heap
from shared.runtime.loop_lag import watch_loop_lag
from shared.runtime.mesh_token import MeshTokenRequired, mesh_token
from shared.runtime.metrics import serve_metrics
from shared.runtime.parent_watch import watch_parent
from shared.runtime.settings import Setting, SettingsParser, add_settings, decimal, port
from shared.runtime.telemetry import configure_tracing
from shared.runtime.tls import server_credentials, tls_config
from shared.runtime.undecodable import UndecodableRequests

LIVENESS = "liveness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Large plans and prompts: lift gRPC's 4 MiB default. Clients ping every 10 s so a dead peer
# is noticed on an idle channel; servers must then allow pings that often, or they answer
# GOAWAY "too_many_pings" and every call on the channel fails.
_MESSAGE_LIMITS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
CHANNEL_OPTIONS = [
    *_MESSAGE_LIMITS,
    # A restarted peer is found within seconds (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 3_000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    *_MESSAGE_LIMITS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# The public port (the gateway) also bounds what one client connection holds: it is closed
# after 5 idle minutes, told to go away after an hour (its streams get 10 more minutes to
# end), and carries at most 1,024 streams at once. Mesh-internal links stay open: a scheduler's
# step stream lives as long as its worker.
PUBLIC_SERVER_OPTIONS = [
    *SERVER_OPTIONS,
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.max_connection_idle_ms", 5 * 60_000),
    ("grpc.max_connection_age_ms", 60 * 60_000),
    ("grpc.max_connection_age_grace_ms", 10 * 60_000),
    ("grpc.max_concurrent_streams", 1024),
]

log = logging.getLogger("kvmesh.service")


def common_settings(default_port: int) -> tuple[Setting, ...]:
    """What every service takes: where it listens, logs, drains, traces and serves metrics."""
    return (
        Setting("host", "127.0.0.1"),
        Setting("port", default_port, None, port),
        Setting("log-level", "INFO"),
        Setting(
            "drain-seconds", 30.0, "grace period for in-flight streams after SIGTERM", decimal(0.0)
        ),
        Setting(
            "otlp-endpoint",
            None,
            "HOST:PORT of an OTLP/gRPC trace receiver (the trace-collector); unset: no tracing",
        ),
        Setting("metrics-port", 0, "serve Prometheus metrics on this port (0: not served)", port),
    )


def service_parser(
    prog: str, description: str, default_port: int, settings: Iterable[Setting]
) -> argparse.ArgumentParser:
    """A service's parser: the common settings, then its own."""
    parser = SettingsParser(prog=prog, description=description)
    add_settings(parser, (*common_settings(default_port), *settings))
    return parser


def start_observability(service_name: str, args: argparse.Namespace) -> None:
    """Tracing to --otlp-endpoint and a Prometheus endpoint on --metrics-port, as flagged."""
    configure_tracing(service_name, args.otlp_endpoint, f"{args.host}:{args.port}")
    if args.metrics_port:
        serve_metrics(args.host, args.metrics_port)


class ServiceRuntime:
    def __init__(
        self,
        service_name: str,
        host: str,
        port: int,
        public: bool = False,
        open_services: tuple[str, ...] = (),
    ) -> None:
        """`open_services`: proto services of an internal server that authenticate callers
        themselves, open without the mesh token."""
        self.service_name = service_name  # full proto name, e.g. kvmesh.v1.Scheduler
        self.public = public  # the gateway: TLS without client certificates unless asked
        self.address = f"{host}:{port}"
        # Undecodable bytes are refused first; a KvmeshError raised by any servicer becomes the
        # rich status in one place (servicers raise, they never abort by hand). An internal
        # server of a mesh with a token refuses anyone without it before either.
        interceptors: list[grpc.aio.ServerInterceptor] = [UndecodableRequests(), KvmeshErrors()]
        token = mesh_token()
        if token and not public:
            open_to_all = (health.SERVICE_NAME, *open_services)
            interceptors.insert(0, MeshTokenRequired(token, open_to_all))
        self._options = PUBLIC_SERVER_OPTIONS if public else SERVER_OPTIONS
        self._interceptors = interceptors
        self.server = grpc.aio.server(options=self._options, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._servicers: list[tuple[Callable[[object, grpc.aio.Server], None], object]] = []
        self._shared: grpc.aio.Server | None = None  # on a port other processes serve too
        self.ready_once = asyncio.Event()  # set the first time it turns ready
        self._serving = False
        self.draining = False
        self._named_ready: dict[str, bool] = {}  # extra health service names, e.g. models
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = asyncio.Event()
        self._lag_watch: asyncio.Task[None] | None = None  # kvmesh_event_loop_lag_seconds

    def add_servicer(
        self, register: Callable[[object, grpc.aio.Server], None], servicer: object
    ) -> None:
        register(servicer, self.server)
        self._servicers.append((register, servicer))

    async def start(self) -> None:
        self._serve_on(self.server, self.address)
        await self.server.start()
        self._lag_watch = asyncio.create_task(watch_loop_lag())
        watch_parent()  # started by a launcher: gone when it is
        await self.health.set(LIVENESS, _SERVING)
        await self.set_ready(False)
        log.info("listening", extra={"address": self.address, "tls": tls_config() is not None})

    def _serve_on(self, server: grpc.aio.Server, address: str) -> None:
        names = (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        tls = tls_config()
        if tls is not None:
            bound = server.add_secure_port(address, server_credentials(tls, self.public))
        else:
            bound = server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot bind {address}")

    async def serve_shared_port(self, address: str) -> None:
        """Serves on `address` too, a port the host's other instances serve (gRPC binds with
        SO_REUSEPORT: the kernel spreads connections among them). Called once ready, so a
        process still starting takes none of them; a drain closes it first."""
        self._shared = grpc.aio.server(options=self._options, interceptors=self._interceptors)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._shared)
        for register, servicer in self._servicers:
            register(servicer, self._shared)
        self._serve_on(self._shared, address)
        await self._shared.start()
        log.info("listening", extra={"address": address, "shared": True})

    async def set_ready(self, ready: bool, named: Mapping[str, bool] | None = None) -> None:
        """Readiness of the whole service, and of `named` health services (the gateway's
        models); a name left out of `named` that was there before turns NOT_SERVING."""
        status = _SERVING if ready and not self.draining else _NOT_SERVING
        if status == _SERVING and not self._serving:
            freeze_startup_heap()  # what it built to be ready lives as long as it serves
            self.ready_once.set()
        self._serving = status == _SERVING
        for name in ("", self.service_name):
            await self.health.set(name, status)
        if named is not None:
            self._named_ready = {**dict.fromkeys(self._named_ready, False), **named}
        for name, named_ready in self._named_ready.items():
            serving = named_ready and not self.draining
            await self.health.set(name, _SERVING if serving else _NOT_SERVING)

    async def set_named_ready(self, name: str, ready: bool) -> None:
        """One named health service alone (a worker's compiled step): the service's own
        readiness stays as it is."""
        self._named_ready[name] = ready
        await self.health.set(name, _SERVING if ready and not self.draining else _NOT_SERVING)

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                "this instance is shutting down; send the request to another",
                retryable=True,
                retry_after_ms=100,
            )

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        """Counts a stream so a drain can wait for it."""
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def serve_until_signalled(
        self,
        grace_seconds: float,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        stop_listening: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Serves until SIGTERM or SIGINT, then drains: not ready, the shared port and
        `stop_listening`'s (an HTTP front's) closed at once, open streams given
        `grace_seconds`, then `on_drain`."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stopped.set)
        await self._stopped.wait()
        log.info("draining", extra={"in_flight": self._inflight, "grace_s": grace_seconds})
        self.draining = True
        await self.set_ready(False)
        # New connections on the shared port go to the other instances from now on.
        shared = None
        if self._shared is not None:
            shared = asyncio.create_task(self._shared.stop(grace_seconds))
        if stop_listening is not None:
            await stop_listening()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_seconds)
        except asyncio.TimeoutError:
            log.warning("grace period over", extra={"in_flight": self._inflight})
        if on_drain is not None:
            await on_drain()
        if shared is not None:
            await shared
        await self.server.stop(grace=1.0)
        if self._lag_watch is not None:
            self._lag_watch.cancel()
        log.info("stopped")

    def stop(self) -> None:
        self._stopped.set()

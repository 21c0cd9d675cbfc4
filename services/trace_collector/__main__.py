"""`python -m services.trace_collector`: receives OTLP spans from every service, answers
kvmesh.v1.Traces queries, and optionally forwards the spans to another OTLP endpoint."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from services.trace_collector.forwarder import OtlpForwarder
from services.trace_collector.server import TraceCollector, TracesService
from services.trace_collector.span_store import SpanStore
from shared.config import parse_bytes
from shared.pb.kvmesh.v1 import traces_pb2_grpc
from shared.runtime.logs import configure_logging
from shared.runtime.metrics import serve_metrics
from shared.runtime.service import ServiceRuntime, service_parser
from shared.runtime.settings import (
    Setting,
    parse_args_or_exit,
    readable_file,
    size,
)
from shared.tenants import ApiKeys

SERVICE_NAME = "kvmesh.v1.Traces"


async def serve(args: argparse.Namespace) -> None:
    # Trace queries check an admin's API key themselves; span export wants the mesh token.
    runtime = ServiceRuntime(SERVICE_NAME, args.host, args.port, open_services=(SERVICE_NAME,))
    store = SpanStore(parse_bytes(args.max_memory))
    forwarder = OtlpForwarder(args.forward) if args.forward else None
    runtime.add_servicer(
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server, TraceCollector(store, forwarder)
    )
    keys = ApiKeys.configured(args.api_keys_file)
    runtime.add_servicer(traces_pb2_grpc.add_TracesServicer_to_server, TracesService(store, keys))
    await runtime.start()
    await runtime.set_ready(True)
    forwarding = asyncio.create_task(forwarder.run()) if forwarder else None
    await runtime.serve_until_signalled(args.drain_seconds)
    if forwarding is not None and forwarder is not None:
        forwarding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await forwarding
        await forwarder.close()


SETTINGS = (
    Setting(
        "max-memory",
        "256MiB",
        "memory budget for stored spans; past it the oldest traces are evicted",
        size,
    ),
    Setting(
        "api-keys-file",
        None,
        "the gateway's tenants (or KVMESH_API_KEYS): then only an admin's key reads traces",
        readable_file,
    ),
    Setting(
        "forward",
        None,
        "also send every span to this OTLP/gRPC endpoint (Jaeger, an OTel Collector)",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of this service (the configuration reference is generated from it)."""
    return service_parser("services.trace_collector", __doc__ or "", 4317, SETTINGS)


def main() -> None:
    args = parse_args_or_exit(build_parser())
    configure_logging("trace-collector", args.log_level)
    if args.metrics_port:  # the collector does not trace itself
        serve_metrics(args.host, args.metrics_port)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

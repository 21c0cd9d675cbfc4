"""`python -m services.trace_collector`: receives OTLP spans from every service."""

from __future__ import annotations

import argparse
import asyncio

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from services.trace_collector.server import TraceCollector
from shared.flags import env_int
from shared.logs import configure_logging
from shared.service import ServiceRuntime, add_common_flags

SERVICE_NAME = "opentelemetry.proto.collector.trace.v1.TraceService"


async def serve(args: argparse.Namespace) -> None:
    runtime = ServiceRuntime(SERVICE_NAME, args.host, args.port)
    runtime.add_servicer(
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server, TraceCollector(args.max_spans)
    )
    await runtime.start()
    await runtime.set_ready(True)
    await runtime.serve_until_signalled(args.drain_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(prog="services.trace_collector", description=__doc__)
    add_common_flags(parser, default_port=4317)
    parser.add_argument(
        "--max-spans",
        type=int,
        default=env_int("max-spans", 100_000),
        help="spans kept; the oldest go first",
    )
    args = parser.parse_args()
    configure_logging("trace-collector", args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

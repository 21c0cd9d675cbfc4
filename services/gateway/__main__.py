"""`python -m services.gateway`: the public kvmesh.v1.Inference API."""

from __future__ import annotations

import argparse
import asyncio

from services.gateway.backends import Backends
from services.gateway.server import InferenceService
from shared.flags import env_default
from shared.logs import configure_logging
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from shared.service import ServiceRuntime, add_common_flags

SERVICE_NAME = "kvmesh.v1.Inference"


async def serve(args: argparse.Namespace) -> None:
    runtime = ServiceRuntime(SERVICE_NAME, args.host, args.port)
    backends = Backends(args.tokenizer, [a for a in args.scheduler.split(",") if a])
    runtime.add_servicer(
        inference_pb2_grpc.add_InferenceServicer_to_server, InferenceService(runtime, backends)
    )
    await runtime.start()
    backends.start(runtime.set_ready)
    await runtime.serve_until_signalled(args.drain_seconds, on_drain=backends.close)


def main() -> None:
    parser = argparse.ArgumentParser(prog="services.gateway", description=__doc__)
    add_common_flags(parser, default_port=50051)
    parser.add_argument(
        "--tokenizer",
        default=env_default("tokenizer", "127.0.0.1:50081"),
        help="tokenizer address",
    )
    parser.add_argument(
        "--scheduler",
        default=env_default("scheduler", "127.0.0.1:50071"),
        help="scheduler addresses, comma-separated",
    )
    args = parser.parse_args()
    configure_logging("gateway", args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

"""`python -m shared.runtime.healthcheck HOST:PORT [SERVICE]`: exit 0 when the service is SERVING.

For container health checks, where no grpc_health_probe binary is at hand."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.runtime.tls import sync_channel


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    service = argv[1] if len(argv) == 2 else ""
    with sync_channel(argv[0]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3
            )
        except grpc.RpcError as error:
            print(f"{argv[0]}: {error.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{argv[0]} {service or '(overall)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

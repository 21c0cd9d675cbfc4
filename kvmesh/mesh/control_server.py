"""MeshControl: `kvmesh up`'s rollout controller over gRPC, for `kvmesh models deploy/rollback`."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc

from kvmesh.mesh.rollout import RolloutController, RolloutStep
from shared import grpc_errors
from shared.errors import KvmeshError
from shared.pb.kvmesh.v1 import mesh_control_pb2, mesh_control_pb2_grpc
from shared.runtime.tls import server_credentials, tls_config
from shared.tenants import ApiKeys


class MeshControlService(mesh_control_pb2_grpc.MeshControlServicer):
    """With auth on (the gateway's API keys), only an admin tenant's key rolls out."""

    def __init__(self, controller: RolloutController, api_keys: ApiKeys) -> None:
        self.controller = controller
        self.api_keys = api_keys

    def _admit(self, context: grpc.ServicerContext) -> None:
        try:
            self.api_keys.require_admin(context.invocation_metadata(), "roll out models")
        except KvmeshError as error:
            _abort(context, error)

    def Deploy(
        self, request: mesh_control_pb2.DeployRequest, context: grpc.ServicerContext
    ) -> Iterator[mesh_control_pb2.RolloutEvent]:
        self._admit(context)
        canary = request.canary_percent if request.HasField("canary_percent") else None
        yield from _events(self.controller.deploy(request.model, request.version, canary), context)

    def Rollback(
        self, request: mesh_control_pb2.RollbackRequest, context: grpc.ServicerContext
    ) -> Iterator[mesh_control_pb2.RolloutEvent]:
        self._admit(context)
        yield from _events(self.controller.rollback(request.model), context)


def _abort(context: grpc.ServicerContext, error: KvmeshError) -> None:
    context.set_trailing_metadata(grpc_errors.trailing_metadata(error))
    context.abort(grpc_errors.status_code(error), error.message)


def _events(
    steps: Iterator[RolloutStep], context: grpc.ServicerContext
) -> Iterator[mesh_control_pb2.RolloutEvent]:
    try:
        for step in steps:
            yield mesh_control_pb2.RolloutEvent(
                message=step.message, traffic=step.traffic, done=step.done
            )
    except KvmeshError as error:
        _abort(context, error)


def serve_control(
    controller: RolloutController, address: str, api_keys: ApiKeys | None = None
) -> grpc.Server:
    """Started and returned; `server.stop(grace)` ends it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service = MeshControlService(controller, api_keys or ApiKeys())
    mesh_control_pb2_grpc.add_MeshControlServicer_to_server(service, server)
    tls = tls_config()
    if tls is not None:
        bound = server.add_secure_port(address, server_credentials(tls, public=False))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    return server

"""ModelAdmin: which schedulers serve which model version, and each model's traffic split.

The rollout controller (`kvmesh models deploy`) drives it. With API keys configured only a
tenant marked `admin = true` may call it; without, the gateway is open anyway.
"""

from __future__ import annotations

import grpc

from services.gateway.mesh.catalog import ModelCatalog
from shared.errors import KvmeshError, Reason
from shared.model_entry import check_name
from shared.pb.kvmesh.v1 import model_admin_pb2, model_admin_pb2_grpc
from shared.tenants import ApiKeys

DEFAULT_DRAIN_TIMEOUT_S = 60.0


class ModelAdminService(model_admin_pb2_grpc.ModelAdminServicer):
    def __init__(self, catalog: ModelCatalog, api_keys: ApiKeys) -> None:
        self.catalog = catalog
        self.api_keys = api_keys

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        self.api_keys.require_admin(context.invocation_metadata(), "change the served models")

    async def AddBackend(
        self, request: model_admin_pb2.AddBackendRequest, context: grpc.aio.ServicerContext
    ) -> model_admin_pb2.AddBackendResponse:
        self._authorize(context)
        check_name("model name", request.model)
        check_name("version", request.version)
        if not request.address:
            raise KvmeshError(Reason.INVALID_ARGUMENT, "a scheduler address is required")
        if request.task not in ("", "generate", "embed"):
            raise KvmeshError(Reason.INVALID_ARGUMENT, "task is 'generate' or 'embed'")
        task = request.task or "generate"
        await self.catalog.registry.add(request.address, request.model, request.version, task)
        return model_admin_pb2.AddBackendResponse()

    async def RemoveBackend(
        self, request: model_admin_pb2.RemoveBackendRequest, context: grpc.aio.ServicerContext
    ) -> model_admin_pb2.RemoveBackendResponse:
        self._authorize(context)
        timeout = request.drain_timeout_s or DEFAULT_DRAIN_TIMEOUT_S
        left = await self.catalog.registry.remove(request.address, timeout)
        return model_admin_pb2.RemoveBackendResponse(streams_left=left)

    async def SetTraffic(
        self, request: model_admin_pb2.SetTrafficRequest, context: grpc.aio.ServicerContext
    ) -> model_admin_pb2.SetTrafficResponse:
        self._authorize(context)
        self.catalog.traffic.set(request.model, dict(request.percent))
        await self.catalog.registry.notify()
        return model_admin_pb2.SetTrafficResponse()

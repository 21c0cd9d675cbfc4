"""ModelAdmin: which schedulers serve which model version, and each model's traffic split.

The rollout controller (`kvmesh models deploy`) drives it. With API keys configured only a
tenant marked `admin = true` may call it; without, the gateway is open anyway.
"""

from __future__ import annotations

import grpc

from services.gateway.backends import Backends
from services.gateway.tenants import ApiKeys
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.model_repository import check_name
from shared.pb.kvmesh.v1 import model_admin_pb2, model_admin_pb2_grpc

DEFAULT_DRAIN_TIMEOUT_S = 60.0


class ModelAdminService(model_admin_pb2_grpc.ModelAdminServicer):
    def __init__(self, backends: Backends, api_keys: ApiKeys) -> None:
        self.backends = backends
        self.api_keys = api_keys

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        try:
            tenant = self.api_keys.authenticate(context.invocation_metadata())
            if self.api_keys.enabled and not tenant.admin:
                raise KvmeshError(
                    Reason.PERMISSION_DENIED, f"tenant {tenant.name!r} is not an admin"
                )
        except KvmeshError as error:
            await grpc_errors.abort(context, error)
            raise

    async def AddBackend(
        self, request: model_admin_pb2.AddBackendRequest, context: grpc.aio.ServicerContext
    ) -> model_admin_pb2.AddBackendResponse:
        await self._authorize(context)
        try:
            check_name("model name", request.model)
            check_name("version", request.version)
            if not request.address:
                raise KvmeshError(Reason.INVALID_ARGUMENT, "a scheduler address is required")
            if request.task not in ("", "generate", "embed"):
                raise KvmeshError(Reason.INVALID_ARGUMENT, "task is 'generate' or 'embed'")
        except KvmeshError as error:
            await grpc_errors.abort(context, error)
            raise
        task = request.task or "generate"
        await self.backends.add(request.address, request.model, request.version, task)
        return model_admin_pb2.AddBackendResponse()

    async def RemoveBackend(
        self, request: model_admin_pb2.RemoveBackendRequest, context: grpc.aio.ServicerContext
    ) -> model_admin_pb2.RemoveBackendResponse:
        await self._authorize(context)
        timeout = request.drain_timeout_s or DEFAULT_DRAIN_TIMEOUT_S
        left = await self.backends.remove(request.address, timeout)
        return model_admin_pb2.RemoveBackendResponse(streams_left=left)

    async def SetTraffic(
        self, request: model_admin_pb2.SetTrafficRequest, context: grpc.aio.ServicerContext
    ) -> model_admin_pb2.SetTrafficResponse:
        await self._authorize(context)
        try:
            self.backends.traffic.set(request.model, dict(request.percent))
        except KvmeshError as error:
            await grpc_errors.abort(context, error)
            raise
        await self.backends.notify()
        return model_admin_pb2.SetTrafficResponse()

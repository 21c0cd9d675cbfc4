"""The public kvmesh.v1.Inference service: thin handlers over the admission and relay code."""

from __future__ import annotations

import contextlib

import grpc

from services.gateway.admission import prompt_token_ids
from services.gateway.backends import Backends
from services.gateway.embed import embed
from services.gateway.generate import GatewayPolicy, GenerateHandler
from services.gateway.stall import ClientStalled, stalled_error, write_or_stall
from services.gateway.tenants import Tenant
from shared import grpc_errors
from shared.errors import KvmeshError
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
)
from shared.service import ServiceRuntime


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self, runtime: ServiceRuntime, backends: Backends, policy: GatewayPolicy | None = None
    ) -> None:
        self.runtime = runtime
        self.backends = backends
        self.policy = policy or GatewayPolicy()
        self.generate = GenerateHandler(runtime, backends, self.policy)

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        try:
            return self.policy.api_keys.authenticate(context.invocation_metadata())
        except KvmeshError as error:
            await grpc_errors.abort(context, error)
            raise

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Explicit writes, not a generator: a write blocked by flow control past the stall
        # timeout can then be given up, and the call still ends with a status.
        stall_s = self.policy.stall_timeout_s
        events = self.generate(request, context)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    try:
                        await write_or_stall(context.write(event), stall_s)
                    except ClientStalled as stalled:
                        with contextlib.suppress(ClientStalled):
                            await events.athrow(stalled)
                        raise stalled_error(stall_s) from None
        except KvmeshError as error:  # refused before the stream started, or stalled
            await grpc_errors.abort(context, error)

    async def Abort(
        self, request: inference_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.AbortResponse:
        tenant = await self._authenticate(context)
        # Another tenant's request is as unknown as one that never existed.
        active = self.generate.active.get((tenant.name, request.request_id))
        if active is None:
            return inference_pb2.AbortResponse(found=False)
        try:
            reply = await active.backend.stub.Abort(
                scheduler_pb2.SchedulerAbortRequest(request_id=active.upstream_id), timeout=5
            )
        except grpc.RpcError as error:
            await grpc_errors.abort(context, grpc_errors.from_rpc_error(error))
            raise
        return inference_pb2.AbortResponse(found=reply.found)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        await self._authenticate(context)
        return inference_pb2.ListModelsResponse(
            models=self.backends.models(), versions=self.backends.versions()
        )

    async def GetModel(
        self, request: inference_pb2.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        await self._authenticate(context)
        try:
            model = self.backends.pick(request.name).model
        except KvmeshError as error:
            await grpc_errors.abort(context, error)
            raise
        assert model is not None
        return model

    async def Embed(
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        await self._authenticate(context)
        with self.runtime.in_flight():
            try:
                self.runtime.refuse_if_draining()
                self.policy.limits.check_size(request.ByteSize())
                return await embed(self.backends, request, context.time_remaining())
            except KvmeshError as error:
                await grpc_errors.abort(context, error)
                raise

    async def _token_ids(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tuple[list[int], common_pb2.ModelInfo]:
        await self._authenticate(context)
        try:
            model = self.backends.pick(request.model).model
            assert model is not None
            ids = await prompt_token_ids(
                request, self.backends.tokenizer, model, context.time_remaining()
            )
        except KvmeshError as error:
            await grpc_errors.abort(context, error)
            raise
        return ids, model

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        ids, _ = await self._token_ids(request, context)
        return inference_pb2.TokenizeResponse(token_ids=ids)

    async def CountTokens(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CountTokensResponse:
        ids, model = await self._token_ids(request, context)
        return inference_pb2.CountTokensResponse(
            count=len(ids),
            max_model_len=model.max_model_len,
            max_output_tokens=max(0, model.max_model_len - len(ids)),
        )

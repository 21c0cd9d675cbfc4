"""The public kvmesh.v1.Inference service: thin handlers over admission, relay and catalog.

Handlers raise KvmeshError; the server's error boundary (shared/runtime/error_boundary.py) turns it
into the rich status.
"""

from __future__ import annotations

import contextlib

import grpc

from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.mesh.peers import PeerGateways, forwarded
from services.gateway.mesh.tokenizer_link import TokenizerLink
from services.gateway.policy.policy import GatewayPolicy
from services.gateway.policy.stall import ClientStalled, stalled_error, write_or_stall
from services.gateway.request.embed import embed
from services.gateway.request.generate import GenerateHandler
from services.gateway.request.tokenize_call import charged_token_ids
from shared import grpc_errors
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
)
from shared.runtime.service import ServiceRuntime


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        runtime: ServiceRuntime,
        catalog: ModelCatalog,
        tokenizer: TokenizerLink,
        policy: GatewayPolicy | None = None,
        peers: PeerGateways | None = None,
    ) -> None:
        self.runtime = runtime
        self.catalog = catalog
        self.tokenizer = tokenizer
        self.policy = policy or GatewayPolicy()
        self.peers = peers  # asked for an Abort of a request this gateway does not hold
        self.generate = GenerateHandler(runtime, catalog, tokenizer, self.policy)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Explicit writes, not a generator: a write blocked by flow control past the stall
        # timeout can then be given up, and the call still ends with a status.
        stall_s = self.policy.stall_timeout_s
        events = self.generate(request, context)
        async with contextlib.aclosing(events):
            async for event in events:
                try:
                    await write_or_stall(context.write(event), stall_s)
                except ClientStalled as stalled:
                    with contextlib.suppress(ClientStalled):
                        await events.athrow(stalled)
                    raise stalled_error(stall_s) from None

    async def Abort(
        self, request: inference_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.AbortResponse:
        metadata = context.invocation_metadata()
        tenant = self.policy.api_keys.authenticate(metadata)
        # Another tenant's request is as unknown as one that never existed.
        placements = self.generate.active.get((tenant.name, request.request_id))
        if placements is None:
            if self.peers is None or forwarded(metadata):
                return inference_pb2.AbortResponse(found=False)
            return inference_pb2.AbortResponse(found=await self.peers.abort(request, metadata))
        found = False
        for active in list(placements):  # every completion of it
            try:
                reply = await active.backend.stub.Abort(
                    scheduler_pb2.SchedulerAbortRequest(request_id=active.upstream_id), timeout=5
                )
            except grpc.RpcError as error:
                raise grpc_errors.from_rpc_error(error) from None
            found |= reply.found
        return inference_pb2.AbortResponse(found=found)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        self.policy.api_keys.authenticate(context.invocation_metadata())
        return inference_pb2.ListModelsResponse(
            models=self.catalog.models(), versions=self.catalog.versions()
        )

    async def GetModel(
        self, request: inference_pb2.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        self.policy.api_keys.authenticate(context.invocation_metadata())
        return self.catalog.pick(request.name).served_model()

    async def Embed(
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        self.policy.api_keys.authenticate(context.invocation_metadata())
        with self.runtime.in_flight():
            self.runtime.refuse_if_draining()
            self.policy.limits.check_size(request.ByteSize())
            return await embed(self.catalog, request, context.time_remaining())

    async def _token_ids(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tuple[list[int], common_pb2.ModelInfo]:
        tenant = self.policy.api_keys.authenticate(context.invocation_metadata())
        model = self.catalog.pick(request.model).served_model()
        remaining = context.time_remaining()
        ids = await charged_token_ids(
            self.policy, self.tokenizer, tenant, request, model, remaining
        )
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

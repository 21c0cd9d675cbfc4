"""One Embed call, shared by the gRPC and HTTP fronts: checked, routed to the least busy ready
embedding worker of the model, answered with the version that embedded it."""

from __future__ import annotations

import logging

import grpc

from services.gateway.mesh.catalog import ModelCatalog
from shared import grpc_errors
from shared.pb.kvmesh.v1 import engine_worker_pb2, inference_pb2

log = logging.getLogger("kvmesh.gateway.embed")


async def embed(
    catalog: ModelCatalog, request: inference_pb2.EmbedRequest, timeout: float | None
) -> inference_pb2.EmbedResponse:
    # The inputs themselves (count, length, token ids) are the embedding worker's to check.
    backend = min(catalog.embedders(request.model), key=lambda b: b.in_flight)
    model = backend.served_model()
    backend.in_flight += 1
    try:
        reply = await backend.embedder.Embed(
            engine_worker_pb2.EmbedInputs(inputs=request.inputs), timeout=timeout
        )
    except grpc.RpcError as error:
        raise grpc_errors.from_rpc_error(error) from None
    finally:
        backend.in_flight -= 1
    tokens = sum(e.num_tokens for e in reply.embeddings)
    log.info("embedded", extra={"inputs": len(request.inputs), "tokens": tokens})
    return inference_pb2.EmbedResponse(
        embeddings=reply.embeddings,
        model=model.name,
        model_version=model.version,
        prompt_tokens=tokens,
    )

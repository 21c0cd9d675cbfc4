"""A small synchronous client of the public API, for the CLI and scripts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc

from shared import grpc_errors
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from shared.runtime.tls import sync_channel


def generate_request(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    token_ids: list[int] | None = None,
    stop: list[str] | None = None,
    timeout_ms: int = 0,
    **sampling: Any,
) -> inference_pb2.GenerateRequest:
    """Exactly one of prompt (raw text), messages (chat) or token_ids; sampling fields by name,
    None meaning "server default"."""
    request = inference_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        stop=stop or [],
        timeout_ms=timeout_ms,
    )
    if messages is not None:
        request.chat.messages.extend(
            common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        request.text = prompt
    return request


def key_metadata() -> tuple[tuple[str, str], ...]:
    """`KVMESH_API_KEY` as gRPC metadata (the CLI's key for a mesh with auth on), or none."""
    key = os.environ.get("KVMESH_API_KEY", "")
    return (("authorization", f"Bearer {key}"),) if key else ()


class MeshClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = sync_channel(address, token="")  # TLS as KVMESH_TLS_* configure
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> MeshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> Iterator[inference_pb2.GenerateEvent]:
        """Events of one Generate call; a refused request raises KvmeshError with its reason."""
        try:
            yield from self.stub.Generate(request, timeout=timeout, metadata=key_metadata())
        except grpc.RpcError as error:
            raise grpc_errors.from_call_to(error, "gateway", self.address) from None

    def models(self) -> list[common_pb2.ModelInfo]:
        listed = self.stub.ListModels(
            inference_pb2.ListModelsRequest(), timeout=10, metadata=key_metadata()
        )
        return list(listed.models)

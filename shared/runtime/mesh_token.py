"""The mesh's own credential on its internal gRPC ports, for meshes without mTLS.

`KVMESH_MESH_TOKEN` set (by `kvmesh up` when auth is on, or by the operator from a Secret), every
internal server (tokenizer, scheduler, engine-worker, trace-collector) refuses a call that does
not carry it as `x-kvmesh-mesh-token` metadata with UNAUTHENTICATED, and every channel made by
`tls.aio_channel` / `tls.sync_channel` sends it. So only the mesh's own services reach a
scheduler's Submit and Abort, and a tenant name or priority comes from a gateway or from no one.
Health stays open (probes carry no metadata); a service that authenticates its callers itself
(the collector's trace queries, by admin API key) is named open by its server. The gateway's
public ports take API keys, never this token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import grpc

from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.runtime.error_boundary import HANDLER_FACTORIES

ENV = "KVMESH_MESH_TOKEN"
METADATA_KEY = "x-kvmesh-mesh-token"


def mesh_token() -> str:
    """This process's mesh token; "" when the mesh runs without one."""
    return os.environ.get(ENV, "")


def new_mesh_token() -> str:
    """A launcher's token for the mesh it starts: every service gets it in its environment."""
    return secrets.token_urlsafe(32)


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class MeshTokenRequired(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, open_services: Iterable[str]) -> None:
        self._digest = _digest(token)
        self._open = tuple(f"/{service}/" for service in open_services)

    def presented(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        given = next((value for key, value in metadata or () if key == METADATA_KEY), None)
        return given is not None and hmac.compare_digest(_digest(given), self._digest)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._open):
            return handler
        if self.presented(handler_call_details.invocation_metadata):
            return handler
        return _refusing(handler, method)


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        error = KvmeshError(Reason.UNAUTHENTICATED, f"{method} is the mesh's own: no mesh token")
        await grpc_errors.abort(context, error)

    for kind, factory in HANDLER_FACTORIES.items():
        if getattr(handler, kind) is not None:
            return factory(refuse, handler.request_deserializer, handler.response_serializer)
    return handler


def _with_token(metadata: Any, token: str) -> tuple[tuple[str, str | bytes], ...]:
    return (*tuple(metadata or ()), (METADATA_KEY, token))


class _AioMeshToken:
    """Adds the token to a call of an asyncio channel. grpc.aio files an interceptor under
    one kind of call only, so each kind has its own (aio_interceptors)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*_with_token(details.metadata, self._token)),
            details.credentials,
            details.wait_for_ready,
        )


class _UnaryUnary(_AioMeshToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_AioMeshToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_AioMeshToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStream(_AioMeshToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def aio_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """What puts the token on every call of an asyncio channel."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class SyncMeshToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """The same for a blocking channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: Any) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

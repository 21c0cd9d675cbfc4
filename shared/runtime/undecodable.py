"""Bytes that do not parse as the method's request message: INVALID_ARGUMENT with a kvmesh
reason, instead of grpcio's UNKNOWN "Unexpected DecodeError" from inside its own framework.

A server interceptor swaps each unary-request handler's deserializer for one that returns a
marker instead of raising, and its behavior for one that refuses the marker."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shared import grpc_errors
from shared.errors import KvmeshError, Reason


class _Undecodable:
    """Stands in for a request that did not parse."""


UNDECODABLE = _Undecodable()


def _refusal(method: str) -> KvmeshError:
    return KvmeshError(
        Reason.INVALID_ARGUMENT, f"the request bytes are not a valid message for {method}"
    )


class UndecodableRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer

        def tolerant(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError:
                return UNDECODABLE

        if handler.response_streaming:
            stream = handler.unary_stream
            if inspect.isasyncgenfunction(stream):

                async def streamed(
                    request: Any, context: grpc.aio.ServicerContext
                ) -> AsyncIterator:
                    if request is UNDECODABLE:
                        await grpc_errors.abort(context, _refusal(method))
                    async for item in stream(request, context):
                        yield item

                behavior: Any = streamed
            else:

                async def written(request: Any, context: grpc.aio.ServicerContext) -> None:
                    if request is UNDECODABLE:
                        await grpc_errors.abort(context, _refusal(method))
                    await stream(request, context)

                behavior = written
            return grpc.unary_stream_rpc_method_handler(
                behavior, tolerant, handler.response_serializer
            )
        unary = handler.unary_unary

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is UNDECODABLE:
                await grpc_errors.abort(context, _refusal(method))
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(answered, tolerant, handler.response_serializer)

"""The one place a KvmeshError becomes a gRPC status: servicers raise, they never abort.

A server interceptor wraps every method handler, unary or streaming, so a KvmeshError raised
anywhere in it (before the first response or between streamed ones) ends the call with the
rich status (code, message, ErrorInfo with the kvmesh reason and `retryable`, RetryInfo).
Other exceptions are left to grpcio, which answers UNKNOWN: those are bugs, not refusals.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from shared import grpc_errors
from shared.errors import KvmeshError

log = logging.getLogger("kvmesh.errors")
# A method handler of each kind, rebuilt around another behavior (here and in mesh_token.py).
HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


async def _refuse(context: grpc.aio.ServicerContext, method: str, error: KvmeshError) -> None:
    log.info(
        "refused",
        extra={"method": method, "reason": error.reason.value, "error": error.message},
    )
    await grpc_errors.abort(context, error)


def _guard(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def streamed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            try:
                async for item in behavior(request, context):
                    yield item
            except KvmeshError as error:
                await _refuse(context, method, error)

        return streamed

    async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except KvmeshError as error:
            await _refuse(context, method, error)

    return answered


class KvmeshErrors(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        for kind, factory in HANDLER_FACTORIES.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                guarded = _guard(behavior, handler_call_details.method)
                return factory(guarded, handler.request_deserializer, handler.response_serializer)
        return handler

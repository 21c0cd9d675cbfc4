"""The one error boundary: a KvmeshError raised by any kind of handler, before or between
streamed responses, reaches the client as the rich status; other exceptions stay UNKNOWN."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from shared.errors import KvmeshError, Reason
from shared.runtime.error_boundary import KvmeshErrors
from tests.e2e.mesh_helpers import rich_error

OVERLOADED = KvmeshError(Reason.OVERLOADED, "busy", retryable=True, retry_after_ms=250)


async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise OVERLOADED


async def refuse_after_one(
    request: bytes, context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    yield b"first"
    raise OVERLOADED


async def refuse_stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for _ in requests:
        raise KvmeshError(Reason.INVALID_ARGUMENT, "no")
    yield b""


async def crash(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise RuntimeError("a bug")


@pytest.fixture
async def server_address() -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[KvmeshErrors()])
    handlers = {
        "Refuse": grpc.unary_unary_rpc_method_handler(refuse),
        "RefuseAfterOne": grpc.unary_stream_rpc_method_handler(refuse_after_one),
        "RefuseStream": grpc.stream_stream_rpc_method_handler(refuse_stream),
        "Crash": grpc.unary_unary_rpc_method_handler(crash),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_every_handler_kind_answers_a_raised_kvmesh_error_with_its_status(
    server_address: str,
) -> None:
    async with grpc.aio.insecure_channel(server_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await channel.unary_unary("/t.T/Refuse")(b"")
        error = rich_error(unary.value)
        assert (error.code, error.reason, error.retryable) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "OVERLOADED",
            True,
        )
        assert error.retry_delay_ms == 250

        call = channel.unary_stream("/t.T/RefuseAfterOne")(b"")
        assert await call.read() == b"first"  # what was sent stays sent
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            await call.read()
        assert rich_error(streamed.value).reason == "OVERLOADED"

        bidi = channel.stream_stream("/t.T/RefuseStream")()
        await bidi.write(b"x")
        with pytest.raises(grpc.aio.AioRpcError) as bidi_error:
            await bidi.read()
        assert rich_error(bidi_error.value).code == grpc.StatusCode.INVALID_ARGUMENT

        with pytest.raises(grpc.aio.AioRpcError) as crashed:
            await channel.unary_unary("/t.T/Crash")(b"")
        assert crashed.value.code() == grpc.StatusCode.UNKNOWN  # a bug is not a refusal

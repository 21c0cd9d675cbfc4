"""Incremental detokenization of one request through the tokenizer service's bidi stream."""

from __future__ import annotations

import asyncio
import time

import grpc

from shared import grpc_errors
from shared.pb.kvmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class TextStream:
    """Incremental detokenization of one request through the tokenizer service."""

    def __init__(
        self,
        tokenizer: tokenizer_pb2_grpc.TokenizerStub,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._call: grpc.aio.StreamStreamCall = tokenizer.Detokenize(metadata=metadata)
        self.wait_s = 0.0  # time spent waiting on the tokenizer, for the trace

    async def push(self, token_ids: list[int], *, finish: bool = False) -> str:
        started = time.monotonic()
        try:
            await self._call.write(
                tokenizer_pb2.DetokenizeRequest(token_ids=token_ids, finish=finish)
            )
            reply = await self._call.read()
        except (grpc.RpcError, asyncio.InvalidStateError):
            # A write after the server ended the call raises InvalidStateError: read its status.
            call = self._call
            raise grpc_errors.from_rpc_error(
                grpc.aio.AioRpcError(
                    await call.code(),
                    await call.initial_metadata(),
                    await call.trailing_metadata(),
                    await call.details(),
                )
            ) from None
        finally:
            self.wait_s += time.monotonic() - started
        return "" if reply is grpc.aio.EOF else reply.text

    def cancel(self) -> None:
        self._call.cancel()

"""Incremental detokenization of one request through the tokenizer service's bidi stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc

from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

log = logging.getLogger("kvmesh.gateway")


class TextStream:
    """Incremental detokenization of one request through the tokenizer service."""

    def __init__(
        self,
        tokenizer: tokenizer_pb2_grpc.TokenizerStub,
        metadata: tuple[tuple[str, str], ...] = (),
        model: str = "",
    ) -> None:
        self._call: grpc.aio.StreamStreamCall = tokenizer.Detokenize(metadata=metadata)
        self._model = model  # whose tokenizer: said in the first message
        self.wait_s = 0.0  # time spent waiting on the tokenizer, for the trace

    async def push(
        self,
        token_ids: list[int],
        *,
        finish: bool = False,
        logprobs: Sequence[common_pb2.TokenLogprobs] = (),
    ) -> str:
        """The text these tokens completed. With `logprobs`, also fills in each entry's (and
        each alternative's) `token_bytes` from the same round trip."""
        started = time.monotonic()
        piece_ids = [
            i for entry in logprobs for i in (entry.token_id, *(t.token_id for t in entry.top))
        ]
        try:
            await self._call.write(
                tokenizer_pb2.DetokenizeRequest(
                    token_ids=token_ids, finish=finish, piece_ids=piece_ids, model=self._model
                )
            )
            reply = await self._call.read()
        except (grpc.RpcError, asyncio.InvalidStateError):
            # A write after the server ended the call raises InvalidStateError: read its status.
            call = self._call
            raise tokenizer_failure(
                grpc.aio.AioRpcError(
                    await call.code(),
                    await call.initial_metadata(),
                    await call.trailing_metadata(),
                    await call.details(),
                )
            ) from None
        finally:
            self.wait_s += time.monotonic() - started
        if reply is grpc.aio.EOF:
            return ""
        pieces = iter(reply.pieces)
        for entry in logprobs:
            entry.token_bytes = next(pieces, b"")
            for top in entry.top:
                top.token_bytes = next(pieces, b"")
        return reply.text

    def cancel(self) -> None:
        self._call.cancel()


def tokenizer_failure(error: grpc.RpcError) -> KvmeshError:
    """The tokenizer's own error, or TOKENIZER_LOST when it is unreachable or died: a status
    without a kvmesh reason that is UNAVAILABLE, CANCELLED or INTERNAL (grpcio's "Internal
    error from Core" when the peer vanished mid-call)."""
    failure = grpc_errors.from_rpc_error(error)
    lost_codes = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
    if error.code() in lost_codes and grpc_errors.rich_status_of(error) is None:
        log.warning("tokenizer lost", extra={"detail": failure.message})  # never to a client
        return KvmeshError(
            Reason.TOKENIZER_LOST,
            "the tokenizer service is unreachable",
            retryable=True,
            retry_after_ms=1000,
        )
    return failure

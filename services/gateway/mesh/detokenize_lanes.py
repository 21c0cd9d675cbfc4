"""One `DetokenizeLanes` stream from this gateway to its tokenizer, shared by every request.

Each request is a lane (`TextStream`). The pushes that queue while a write is in flight go as one
message (shared_stream.py), and one reader hands each lane its answer. At batch 128 the
scheduler's events for a step arrive together, so a step's tokens cross in about two messages
instead of 256, and the gateway's per-token cost falls by the two gRPC operations each token
took on a stream of its own.

The stream opens with the first push and again after a break: a break fails every lane on it
(TOKENIZER_LOST; the tokenizer forgot their state) and lanes opened later go on a new stream.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from services.gateway.mesh.shared_stream import Call, SharedStream
from services.gateway.mesh.tokenizer_errors import tokenizer_failure, tokenizer_lost
from shared.errors import KvmeshError
from shared.pb.kvmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class DetokenizeLanes(SharedStream[tokenizer_pb2.DetokenizeLane]):
    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        super().__init__(stub.DetokenizeLanes, _message)
        self._numbers = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tokenizer_pb2.DetokenizedLane]] = {}

    def new_lane(self) -> int:
        return next(self._numbers)

    def stream(self, call: Call | None) -> Call:
        """The stream a lane goes on: the current one (opened if none) for a new lane (None);
        its own for a lane that has one, which must not have broken since."""
        current = self._open() if call is None else call
        if current is not self._call:
            raise tokenizer_lost("the tokenizer service restarted during this request")
        return current

    async def exchange(
        self, entry: tokenizer_pb2.DetokenizeLane, call: Call
    ) -> tokenizer_pb2.DetokenizedLane:
        """The tokenizer's answer to `entry`, sent on `call`, the lane's stream (`stream`)."""
        (answered,) = await self.exchange_all([entry], call)
        return answered

    async def exchange_all(
        self, entries: list[tokenizer_pb2.DetokenizeLane], call: Call
    ) -> list[tokenizer_pb2.DetokenizedLane]:
        """The answers to several lanes' entries, sent together on `call`."""
        if call is not self._call:
            raise tokenizer_lost("the tokenizer service restarted during this request")
        loop = asyncio.get_running_loop()
        answers = [loop.create_future() for _ in entries]
        for entry, answer in zip(entries, answers, strict=True):
            self._waiting[entry.lane] = answer
            self._send(entry)
        try:
            return [await answer for answer in answers]
        finally:
            for entry, answer in zip(entries, answers, strict=True):
                self._waiting.pop(entry.lane, None)
                if answer.done() and not answer.cancelled():
                    answer.exception()  # a break fails them all; the first one is raised
                else:
                    answer.cancel()

    def close(self, lane: int, call: Call) -> None:
        """Forget a lane whose request ended before its finish (no reply comes)."""
        if call is self._call:
            self._send(tokenizer_pb2.DetokenizeLane(lane=lane, close=True))

    async def aclose(self) -> None:
        if self._call is not None:
            self._broken(self._call, tokenizer_lost("the gateway is stopping"))
        await self._cancel_tasks()

    async def _read(self, call: Call) -> None:
        try:
            async for reply in call:
                for answered in reply.lanes:
                    future = self._waiting.get(answered.lane)
                    if future is not None and not future.done():
                        future.set_result(answered)
            failure = tokenizer_lost("the tokenizer service ended the detokenize stream")
        except grpc.RpcError as error:
            failure = tokenizer_failure(error)
        self._broken(call, failure)

    def _broken(self, broken: Call, failure: KvmeshError) -> None:
        if not self._forget(broken):
            return
        for future in self._waiting.values():
            if not future.done():  # an exception of its own: each lane's task raises it
                future.set_exception(
                    KvmeshError(
                        failure.reason,
                        failure.message,
                        retryable=failure.retryable,
                        retry_after_ms=failure.retry_after_ms,
                    )
                )


def _message(lanes: list[tokenizer_pb2.DetokenizeLane]) -> tokenizer_pb2.DetokenizeLanesRequest:
    return tokenizer_pb2.DetokenizeLanesRequest(lanes=lanes)

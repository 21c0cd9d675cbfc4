"""One `DetokenizeLanes` stream from this gateway to its tokenizer, shared by every request.

Each request is a lane (`TextStream`). A lane's push joins an outbox; one writer sends all that
queued while the last write was in flight as one message, and one reader hands each lane its
answer. At batch 128 the scheduler's events for a step arrive together, so a step's tokens
cross in about two messages instead of 256, and the gateway's per-token cost falls by the two
gRPC operations each token took on a stream of its own.

The stream opens with the first push and again after a break: a break fails every lane on it
(TOKENIZER_LOST; the tokenizer forgot their state) and lanes opened later go on a new stream.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TypeAlias

import grpc

from services.gateway.mesh.tokenizer_errors import tokenizer_failure, tokenizer_lost
from shared.errors import KvmeshError
from shared.pb.kvmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc

Call: TypeAlias = grpc.aio.StreamStreamCall


class DetokenizeLanes:
    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self._stub = stub
        self._numbers = itertools.count(1)
        self._call: Call | None = None
        self._outbox: list[tokenizer_pb2.DetokenizeLane] = []
        self._waiting: dict[int, asyncio.Future[tokenizer_pb2.DetokenizedLane]] = {}
        self._writer: asyncio.Task[None] | None = None
        self._writing_to: Call | None = None  # the stream self._writer writes to
        self._tasks: set[asyncio.Task[None]] = set()

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
        if call is not self._call:
            raise tokenizer_lost("the tokenizer service restarted during this request")
        answer: asyncio.Future[tokenizer_pb2.DetokenizedLane] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[entry.lane] = answer
        self._send(entry)
        try:
            return await answer
        finally:
            self._waiting.pop(entry.lane, None)

    def close(self, lane: int, call: Call) -> None:
        """Forget a lane whose request ended before its finish (no reply comes)."""
        if call is self._call:
            self._send(tokenizer_pb2.DetokenizeLane(lane=lane, close=True))

    async def aclose(self) -> None:
        if self._call is not None:
            self._broken(self._call, tokenizer_lost("the gateway is stopping"))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _open(self) -> Call:
        if self._call is None:
            self._call = self._stub.DetokenizeLanes()
            self._hold(asyncio.create_task(self._read(self._call)))
        return self._call

    def _hold(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """Kept referenced until it ends (the loop holds tasks weakly), and cancelled at close."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _send(self, entry: tokenizer_pb2.DetokenizeLane) -> None:
        self._outbox.append(entry)
        if self._writer is None or self._writer.done() or self._writing_to is not self._call:
            # Started, not run: the other lanes' pushes of this loop turn join its message.
            self._writing_to = self._call
            self._writer = self._hold(asyncio.create_task(self._write(self._call)))

    async def _write(self, call: Call | None) -> None:
        """Until the outbox is empty; a writer for a broken stream stops at its next turn."""
        try:
            while self._outbox and self._call is call and call is not None:
                batch, self._outbox = self._outbox, []
                await call.write(tokenizer_pb2.DetokenizeLanesRequest(lanes=batch))
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the reader sees the same break and reads the call's status

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
        broken.cancel()  # a no-op once it ended
        if self._call is not broken:
            return
        self._call = None
        self._outbox.clear()  # all of it was for this stream
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

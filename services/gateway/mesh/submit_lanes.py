"""One `SubmitLanes` stream from this gateway to a scheduler, shared by every request there.

Each request is a lane (`LaneCall`), read and cancelled as its own Submit call would be. Opens
and cancels that queue while a write is in flight go as one message (shared_stream.py). One
reader hands each lane its events: the scheduler sends a step's events as one message, so at
batch 128 the gateway reads one message a step instead of 128, its plain tokens as two columns
(lanes, token ids) read before its events. Tokens that reach a lane whose relay has not read
the previous ones yet join them (token_events.py): one delta, not a backlog of a delta a
token, each ~100 µs of the gateway's.

The stream opens with the first request and again after a break: a break fails every lane on it
with the stream's error, as each Submit call would have failed, and a request placed later goes
on a new stream.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeAlias

import grpc

from services.gateway.mesh.shared_stream import Call, SharedStream
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.token_events import join_tokens

Event = scheduler_pb2.SubmitEvent
EndOfStream: TypeAlias = Any  # grpc.aio.EOF (grpcio ships no type for it)
# What a lane's reader gets next: an event, the stream's end, or the error that broke it.
Item: TypeAlias = Event | EndOfStream | BaseException


class Divert(Protocol):
    """Takes a lane's tokens instead of its reader (a parked relay: parked_relays.py). Only a
    plain stream past its first token is diverted: its tokens are ids and nothing else."""

    def take(self, token_ids: Iterable[int]) -> None: ...

    def interrupt(self) -> None:
        """Anything else reached the lane: its reader must read it."""


class LaneCall:
    """One request on a `SubmitLanes` stream: `read()` and `cancel()` as on a Submit call."""

    def __init__(self, lanes: SubmitLanes, number: int, call: Call, deadline: float | None) -> None:
        self._lanes = lanes
        self.number = number
        self.call = call
        self._items: collections.deque[Item] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None  # a read waiting for an item
        self.divert: Divert | None = None  # takes the tokens while nothing else is unread
        # Whether the scheduler still runs the lane: it ends it after a terminal event, unless
        # a prefill-only request holds its blocks for the handover until cancelled.
        self.open_upstream = True
        self._timer = (
            None
            if deadline is None
            else asyncio.get_running_loop().call_at(deadline, self._expired)
        )

    async def read(self) -> Event | EndOfStream:
        """The next event; raises the stream's error when it broke, or DEADLINE_EXCEEDED."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items[0]
        if isinstance(item, BaseException):
            raise item  # left in place: every later read fails the same way
        return self._items.popleft()

    @property
    def only_tokens_unread(self) -> bool:
        """Nothing unread, or tokens alone: what a diverted reader can take on."""
        return not self._items or self._unread_tokens() is not None

    def divert_to(self, divert: Divert) -> None:
        """`divert` takes the tokens from here on, first those unread when they are all that
        is (only_tokens_unread)."""
        self.divert = divert
        if (unread := self._unread_tokens()) is not None:
            self._items.clear()
            divert.take(unread.token_ids)

    def _unread_tokens(self) -> scheduler_pb2.SubmitTokens | None:
        """The tokens unread when nothing else is (unread tokens join into one event)."""
        item = self._items[0] if len(self._items) == 1 else None
        return item.tokens if isinstance(item, Event) and item.HasField("tokens") else None

    def undivert(self, left: list[int] | None = None) -> None:
        """The reader takes the tokens again, first the diverted ones not yet relayed."""
        self.divert = None
        if left is not None:
            self._items.appendleft(Event(tokens=scheduler_pb2.SubmitTokens(token_ids=left)))

    def cancel(self) -> None:
        """Aborts the request upstream (or ends a prefill-only lane's hold); later reads see
        the stream's end."""
        self._stop_timer()
        self._lanes.cancel(self)
        self._put(grpc.aio.EOF)

    def delivered(self, event: Event) -> None:
        kind = event.WhichOneof("event")
        unread = self._items[-1] if self._items else None
        if kind == "tokens" and self.divert is not None and unread is None:
            self.divert.take(event.tokens.token_ids)
        elif kind == "tokens" and isinstance(unread, Event) and unread.HasField("tokens"):
            join_tokens(unread.tokens, event.tokens)
        else:
            self._put(event)
        if kind == "failed" or (kind == "finished" and not event.finished.HasField("handover")):
            self.open_upstream = False
            self._stop_timer()

    def token_delivered(self, token: int) -> None:
        """`delivered` for a plain token from the reply's columns."""
        unread = self._items[-1] if self._items else None
        if isinstance(unread, Event) and unread.HasField("tokens"):
            unread.tokens.token_ids.append(token)
        elif self.divert is not None and unread is None:
            self.divert.take((token,))
        else:
            self._put(Event(tokens=scheduler_pb2.SubmitTokens(token_ids=(token,))))

    def broken(self, item: Item) -> None:
        self.open_upstream = False
        self._stop_timer()
        self._put(item)

    def _put(self, item: Item) -> None:
        self._items.append(item)
        if self.divert is not None:
            self.divert.interrupt()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _expired(self) -> None:
        """The scheduler fails a request shortly before its deadline; this is for one that
        could not, as a Submit call's own deadline was."""
        self._timer = None
        self._lanes.cancel(self)
        self.broken(KvmeshError(Reason.DEADLINE_EXCEEDED, "the scheduler did not answer in time"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class SubmitLanes(SharedStream[scheduler_pb2.SubmitLane]):
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        super().__init__(stub.SubmitLanes, _message)
        self._numbers = itertools.count(1)
        self._lanes: dict[int, LaneCall] = {}

    def submit(
        self,
        request: scheduler_pb2.SubmitRequest,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
    ) -> LaneCall:
        """Sends `request` on a lane of its own; `timeout` is its deadline, seconds from now."""
        call = self._open()
        deadline = None if timeout is None else time.monotonic() + timeout
        lane = LaneCall(self, next(self._numbers), call, deadline)
        self._lanes[lane.number] = lane
        self._send(
            scheduler_pb2.SubmitLane(
                lane=lane.number,
                submit=request,
                timeout_s=timeout or 0.0,
                trace_context=dict(metadata),
            )
        )
        return lane

    def cancel(self, lane: LaneCall) -> None:
        self._lanes.pop(lane.number, None)
        if lane.open_upstream and lane.call is self._call:
            lane.open_upstream = False
            self._send(scheduler_pb2.SubmitLane(lane=lane.number, cancel=True))

    async def aclose(self) -> None:
        if self._call is not None:
            self._broken(self._call, grpc.aio.EOF)
        await self._cancel_tasks()

    async def _read(self, call: Call) -> None:
        ended: Item = grpc.aio.EOF
        try:
            async for reply in call:
                lanes = self._lanes
                for number, token in zip(reply.token_lanes, reply.token_ids, strict=True):
                    if (lane := lanes.get(number)) is not None:  # else cancelled here
                        lane.token_delivered(token)
                for entry in reply.events:  # after a lane's column tokens (scheduler.proto)
                    lane = self._lanes.get(entry.lane)
                    if lane is None:
                        continue  # cancelled here; the scheduler's events crossed it
                    lane.delivered(entry.event)
                    if not lane.open_upstream:
                        del self._lanes[entry.lane]
        except grpc.RpcError as error:
            ended = error
        self._broken(call, ended)

    def _broken(self, broken: Call, ended: Item) -> None:
        """Every lane on `broken` reads `ended` (the scheduler ended or lost them all)."""
        if not self._forget(broken):
            return
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.broken(ended)


def _message(lanes: list[scheduler_pb2.SubmitLane]) -> scheduler_pb2.SubmitLanesRequest:
    return scheduler_pb2.SubmitLanesRequest(lanes=lanes)

"""The scheduler's side of a `SubmitLanes` stream: many requests on one stream, each a lane.

Each lane runs a request's events (the same iterator a Submit call streams) in a task of its
own; what the lanes yield joins one outbox, and each reply carries all that joined while the
last reply was written. Once accepted, a lane's tokens go into the outbox from the step loop
itself (`Tracked.lane`, a `LaneWriter`), written in place into the reply being built: its task
wakes only for its terminal event. Plain tokens go in the reply's two token columns while the
lane has no event in it, else they join its tokens event (token_events.py). A step leaves in
one message: at batch 128 the gateway reads one message a step instead of 128.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import scheduler_pb2

log = logging.getLogger("kvmesh.scheduler.lanes")
Metadata = Sequence[tuple[str, str | bytes]]


class LaneWriter:
    """Where the step loop writes a lane's tokens: the reply being built."""

    __slots__ = ("_lane", "_stream")

    def __init__(self, stream: LaneStream, lane: int) -> None:
        self._stream = stream
        self._lane = lane

    def tokens(self) -> scheduler_pb2.SubmitTokens:
        """A tokens event to fill (the first tokens, logprobs, held ones), joining the lane's
        still unsent."""
        return self._stream._tokens(self._lane)

    def plain(self, token_ids: Sequence[int]) -> None:
        """Tokens with nothing else to carry."""
        self._stream._plain(self._lane, token_ids)


# (request, deadline on the monotonic clock or None, trace metadata, where its tokens may go
# directly once accepted) -> its events.
Events = Callable[
    [scheduler_pb2.SubmitRequest, float | None, Metadata, LaneWriter],
    AsyncGenerator[scheduler_pb2.SubmitEvent, None],
]


class LaneStream:
    """The lanes of one stream, by the caller's numbers. A lane's refusal or failure ends that
    lane with a `failed` event; the stream carries every request of a gateway."""

    def __init__(self, events: Events) -> None:
        self._events = events
        self._lanes: dict[int, asyncio.Task[None]] = {}
        # The outbox is the next reply itself: an event written into it is not copied again
        # (a token's message built and copied three times was 3.7 µs of 0.9 at batch 256).
        self._outbox = scheduler_pb2.SubmitLanesResponse()
        self._unsent_tokens: dict[int, scheduler_pb2.SubmitTokens] = {}  # in the outbox, by lane
        self._with_events: set[int] = set()  # lanes with an event in the outbox
        # The outbox's token columns, as lists until its reply is written: a list append is
        # 0.09 µs, a repeated field's 0.6, a nested event entry's 2.9.
        self._plain_lanes: list[int] = []
        self._plain_ids: list[int] = []
        self._news = asyncio.Event()

    async def replies(
        self, requests: AsyncIterator[scheduler_pb2.SubmitLanesRequest]
    ) -> AsyncGenerator[scheduler_pb2.SubmitLanesResponse, None]:
        """Until the caller has closed its side and every lane has ended; the caller's cancel
        (or a broken stream) cancels every lane, which aborts their requests."""
        reader = asyncio.create_task(self._read(requests))
        reader.add_done_callback(lambda _: self._news.set())
        try:
            while True:
                await self._news.wait()
                self._news.clear()
                if self._outbox.events or self._plain_lanes:
                    yield self._take_reply()
                idle = not (self._outbox.events or self._plain_lanes)
                if reader.done() and not self._lanes and idle:
                    reader.result()  # a broken read ends the call with its error
                    return
        finally:
            tasks = [reader, *self._lanes.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[scheduler_pb2.SubmitLanesRequest]) -> None:
        async for message in requests:
            for entry in message.lanes:  # in order: an open, then a cancel of the same lane
                if entry.cancel:
                    task = self._lanes.pop(entry.lane, None)
                    if task is not None:
                        task.cancel()
                elif entry.lane in self._lanes:
                    self._post(
                        entry.lane,
                        _failed(Reason.INVALID_ARGUMENT, f"lane {entry.lane} is already open"),
                    )
                else:
                    self._open(entry)

    def _open(self, entry: scheduler_pb2.SubmitLane) -> None:
        deadline = time.monotonic() + entry.timeout_s if entry.timeout_s > 0 else None
        metadata = tuple(entry.trace_context.items())
        task = asyncio.create_task(self._run(entry.lane, entry.submit, deadline, metadata))
        self._lanes[entry.lane] = task
        task.add_done_callback(functools.partial(self._ended, entry.lane))

    async def _run(
        self,
        lane: int,
        request: scheduler_pb2.SubmitRequest,
        deadline: float | None,
        metadata: Metadata,
    ) -> None:
        try:
            events = self._events(request, deadline, metadata, LaneWriter(self, lane))
            async with contextlib.aclosing(events):
                async for event in events:
                    self._post(lane, event)
        except KvmeshError as error:
            log.info("refused", extra={"reason": error.reason.value, "error": error.message})
            self._post(lane, scheduler_pb2.SubmitEvent(failed=grpc_errors.to_pb(error)))
        except Exception:  # a bug: this lane fails, the stream and the other lanes go on
            log.exception("lane failed", extra={"request_id": request.request_id})
            self._post(lane, _failed(Reason.INTERNAL, "the scheduler failed this request"))

    def _take_reply(self) -> scheduler_pb2.SubmitLanesResponse:
        reply, self._outbox = self._outbox, scheduler_pb2.SubmitLanesResponse()
        reply.token_lanes.extend(self._plain_lanes)
        reply.token_ids.extend(self._plain_ids)
        self._plain_lanes.clear()
        self._plain_ids.clear()
        self._unsent_tokens.clear()
        self._with_events.clear()
        return reply

    def _post(self, lane: int, event: scheduler_pb2.SubmitEvent) -> None:
        self._unsent_tokens.pop(lane, None)  # no later tokens join across this event
        self._with_events.add(lane)
        self._outbox.events.add(lane=lane, event=event)
        self._news.set()

    def _plain(self, lane: int, token_ids: Sequence[int]) -> None:
        if lane in self._with_events:  # read after its column tokens: these must follow it
            self._tokens(lane).token_ids.extend(token_ids)
            return
        if len(token_ids) == 1:
            self._plain_lanes.append(lane)
        else:
            self._plain_lanes.extend([lane] * len(token_ids))
        self._plain_ids.extend(token_ids)
        self._news.set()

    def _tokens(self, lane: int) -> scheduler_pb2.SubmitTokens:
        """Where the step loop writes a step's tokens for `lane`: its tokens still waiting in
        the outbox (the last reply is still being written), which they join, else a new
        entry (empty: the caller fills it at once)."""
        unsent = self._unsent_tokens.get(lane)
        if unsent is None:
            unsent = self._outbox.events.add(lane=lane).event.tokens
            unsent.SetInParent()
            self._unsent_tokens[lane] = unsent
            self._with_events.add(lane)
            self._news.set()
        return unsent

    def _ended(self, lane: int, task: asyncio.Task[None]) -> None:
        if self._lanes.get(lane) is task:
            del self._lanes[lane]
        self._news.set()


def _failed(reason: Reason, message: str) -> scheduler_pb2.SubmitEvent:
    return scheduler_pb2.SubmitEvent(failed=grpc_errors.to_pb(KvmeshError(reason, message)))

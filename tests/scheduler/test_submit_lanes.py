"""Every request's events on one shared stream: the scheduler's `LaneStream` behind a real gRPC
server on loopback, and the gateway's client (`SubmitLanes`, `LaneCall`). The scheduler here
is scripted: a request's events come from a queue that `step()` fills for every open request in
one pass, as the step loop does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager

import grpc
import pytest

from kvmesh.mesh.service_process import free_port
from services.gateway.mesh.submit_lanes import LaneCall, SubmitLanes
from services.gateway.request.request_record import upstream_failure
from services.scheduler.submit_lanes import LaneStream, LaneWriter
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.runtime.service import ServiceRuntime
from shared.runtime.tls import aio_channel

Event = scheduler_pb2.SubmitEvent


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[Event]] = {}
        self.ended: dict[str, str] = {}  # request id -> "finished" or "closed" (aborted)
        self.deadlines: dict[str, float | None] = {}
        self.metadata: dict[str, dict[str, str | bytes]] = {}
        self.refused: set[str] = set()
        self.replies: list[int] = []  # tokens and events in each reply, in order
        self.sent: list[scheduler_pb2.SubmitLanesResponse] = []
        self.lanes: dict[str, LaneWriter] = {}  # each accepted lane's

    async def events(
        self,
        request: scheduler_pb2.SubmitRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
        lane: LaneWriter,
    ) -> AsyncGenerator[Event, None]:
        name = request.request_id
        if name in self.refused:
            raise KvmeshError(Reason.OVERLOADED, "queue full", retryable=True, retry_after_ms=250)
        self.deadlines[name], self.metadata[name] = deadline, dict(metadata)
        queue = self.queues[name] = asyncio.Queue()
        try:
            yield Event(accepted=scheduler_pb2.SubmitAccepted(queue_position=len(self.queues)))
            self.lanes[name] = lane  # tokens from here on, as the step loop's go
            while True:
                event = await queue.get()
                yield event
                if event.WhichOneof("event") == "finished":
                    if event.finished.HasField("handover"):
                        await asyncio.Event().wait()  # held for the decode pair's pull
                    self.ended[name] = "finished"
                    return
        finally:
            self.ended.setdefault(name, "closed")
            del self.queues[name]
            self.lanes.pop(name, None)

    def step(self, finish: bool = False) -> None:
        """One token for every open request, in one pass; `finish` ends them too."""
        for name, queue in self.queues.items():
            if name in self.lanes:
                self.lanes[name].plain([_token(name)])
            else:
                queue.put_nowait(Event(tokens=scheduler_pb2.SubmitTokens(token_ids=[_token(name)])))
            if finish:
                queue.put_nowait(Event(finished=scheduler_pb2.SubmitFinished()))

    async def SubmitLanes(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for reply in LaneStream(self.events).replies(request_iterator):
            self.replies.append(len(reply.token_ids) + len(reply.events))
            self.sent.append(reply)
            yield reply


def _token(name: str) -> int:
    return int(name.removeprefix("r"))


@asynccontextmanager
async def scheduler(port: int) -> AsyncIterator[ScriptedScheduler]:
    runtime = ServiceRuntime("kvmesh.v1.Scheduler", "127.0.0.1", port)
    service = ScriptedScheduler()
    runtime.add_servicer(scheduler_pb2_grpc.add_SchedulerServicer_to_server, service)
    await runtime.start()
    try:
        yield service
    finally:
        await runtime.server.stop(grace=None)


@asynccontextmanager
async def gateway_lanes(port: int) -> AsyncIterator[SubmitLanes]:
    channel = aio_channel(f"127.0.0.1:{port}")
    lanes = SubmitLanes(scheduler_pb2_grpc.SchedulerStub(channel))
    try:
        yield lanes
    finally:
        await lanes.aclose()
        await channel.close()


def submit(lanes: SubmitLanes, name: str, **request: object) -> LaneCall:
    return lanes.submit(
        scheduler_pb2.SubmitRequest(request_id=name, **request),  # type: ignore[arg-type]
        timeout=30,
        metadata=(),
    )


async def until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def accepted(calls: list[LaneCall]) -> None:
    for call in calls:
        first = await call.read()
        assert first.WhichOneof("event") == "accepted"


async def test_a_steps_events_cross_in_one_message_and_reach_their_own_request() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        calls = [submit(lanes, f"r{i}") for i in range(32)]
        await accepted(calls)
        before = len(service.replies)
        for step in range(4):
            service.step(finish=step == 3)
            for i, call in enumerate(calls):
                event = await call.read()
                assert list(event.tokens.token_ids) == [i]
        for call in calls:
            assert (await call.read()).WhichOneof("event") == "finished"
        await until(lambda: len(service.ended) == 32)
        assert set(service.ended.values()) == {"finished"}
        # Each step's tokens one message of 32 tokens in columns, straight from the step; the
        # finishes, which wake their lanes' tasks, one more.
        assert service.replies[before:] == [32, 32, 32, 32, 32]
        assert [len(reply.token_ids) for reply in service.sent[before:]] == [32, 32, 32, 32, 0]


async def test_steps_before_the_reply_is_written_leave_in_it_and_read_as_one_event_a_lane() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        calls = [submit(lanes, f"r{i}") for i in range(8)]
        await accepted(calls)
        before = len(service.replies)
        service.step()
        service.step()  # before the outbox was written: the second step's tokens join
        for i, call in enumerate(calls):
            assert list((await call.read()).tokens.token_ids) == [i, i]
        assert service.replies[before:] == [16]  # one message, its columns read as 8 events


async def test_tokens_a_lane_has_not_read_yet_join_into_one_event() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        behind, keeping_up = submit(lanes, "r7"), submit(lanes, "r9")
        await accepted([behind, keeping_up])
        for _ in range(3):
            before = len(service.replies)
            service.step()
            assert list((await keeping_up.read()).tokens.token_ids) == [9]  # one a step
            await until(lambda sent=before: len(service.replies) > sent)
        service.step(finish=True)
        assert list((await keeping_up.read()).tokens.token_ids) == [9]
        assert (await keeping_up.read()).WhichOneof("event") == "finished"
        assert list((await behind.read()).tokens.token_ids) == [7, 7, 7, 7]  # one event
        assert (await behind.read()).WhichOneof("event") == "finished"


async def test_plain_tokens_ride_in_columns_until_their_lane_has_an_event_in_the_reply() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        plain, evented = submit(lanes, "r1"), submit(lanes, "r2")
        await accepted([plain, evented])
        before = len(service.sent)
        service.lanes["r1"].plain([1])
        first = service.lanes["r2"].tokens()  # a first token's event, timings and all
        first.token_ids.append(2)
        first.first.queue_ms = 5.0
        service.lanes["r2"].plain([2])  # after an event of its lane: joins it, not the columns
        service.lanes["r1"].plain([1, 1])
        await until(lambda: len(service.sent) > before)
        (reply,) = service.sent[before:]
        assert list(reply.token_ids) == [1, 1, 1] and len(set(reply.token_lanes)) == 1
        assert [list(entry.event.tokens.token_ids) for entry in reply.events] == [[2, 2]]
        assert list((await plain.read()).tokens.token_ids) == [1, 1, 1]  # joined, one event
        tokens = (await evented.read()).tokens
        assert list(tokens.token_ids) == [2, 2] and tokens.first.queue_ms == 5.0


class OneReply:
    """A scheduler's side of a SubmitLanes call that sends one reply and ends."""

    def __init__(self, reply: scheduler_pb2.SubmitLanesResponse) -> None:
        self.reply = reply

    def __call__(self) -> OneReply:
        return self

    async def __aiter__(self) -> AsyncIterator[scheduler_pb2.SubmitLanesResponse]:
        await asyncio.sleep(0.05)  # after the lane was opened
        yield self.reply

    async def write(self, message: object) -> None:
        pass

    def cancel(self) -> bool:
        return False


async def test_a_lanes_column_tokens_are_read_before_its_events_in_the_same_reply() -> None:
    reply = scheduler_pb2.SubmitLanesResponse(token_lanes=[1, 1], token_ids=[7, 8])
    reply.events.add(lane=1).event.finished.finish_reason = 1
    stub = type("Stub", (), {"SubmitLanes": OneReply(reply)})()
    lanes = SubmitLanes(stub)  # type: ignore[arg-type]
    lane = submit(lanes, "r1")
    assert list((await lane.read()).tokens.token_ids) == [7, 8]
    assert (await lane.read()).WhichOneof("event") == "finished"
    await lanes.aclose()


class Diverted:
    """A parked relay's part of a lane: the tokens it was handed, and whether it was told to
    give the lane back to its reader."""

    def __init__(self) -> None:
        self.handed: list[list[int]] = []
        self.interrupted = False

    def take(self, token_ids: Iterable[int]) -> None:
        self.handed.append(list(token_ids))

    def interrupt(self) -> None:
        self.interrupted = True


async def test_a_lane_behind_is_diverted_with_its_unread_tokens_first() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        behind = submit(lanes, "r5")
        await accepted([behind])
        for _ in range(2):
            before = len(service.replies)
            service.step()
            await until(lambda sent=before: len(service.replies) > sent)
        assert behind.only_tokens_unread  # two steps' tokens, joined, wait for its reader
        diverted = Diverted()
        behind.divert_to(diverted)
        assert diverted.handed == [[5, 5]]
        service.step()
        await until(lambda: len(diverted.handed) == 2)
        assert diverted.handed[1] == [5] and not diverted.interrupted
        service.step(finish=True)  # a token, then the terminal event: the reader's again
        await until(lambda: diverted.interrupted)
        assert diverted.handed[2] == [5] and not behind.only_tokens_unread
        behind.undivert()
        # Nothing it was handed is read again: the reader's next event is the terminal one.
        assert (await behind.read()).WhichOneof("event") == "finished"


async def test_a_cancelled_lane_aborts_its_request_and_no_other() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        kept, cancelled = submit(lanes, "r1"), submit(lanes, "r2")
        await accepted([kept, cancelled])
        cancelled.cancel()
        await until(lambda: "r2" in service.ended)
        assert service.ended == {"r2": "closed"}
        assert await cancelled.read() is grpc.aio.EOF
        service.step(finish=True)
        assert list((await kept.read()).tokens.token_ids) == [1]
        assert (await kept.read()).WhichOneof("event") == "finished"


async def test_a_refusal_is_a_failed_event_before_acceptance() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        service.refused.add("r7")
        refused, other = submit(lanes, "r7"), submit(lanes, "r8")
        event = await refused.read()
        assert event.WhichOneof("event") == "failed"
        error = grpc_errors.from_pb(event.failed)
        assert (error.reason, error.retryable, error.retry_after_ms) == (
            Reason.OVERLOADED,
            True,
            250,
        )
        await accepted([other])  # the stream carries on


async def test_deadline_and_trace_context_travel_with_the_request() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        sent = time.monotonic()
        call = lanes.submit(
            scheduler_pb2.SubmitRequest(request_id="r3"),
            timeout=5.0,
            metadata=(("traceparent", traceparent),),
        )
        untimed = lanes.submit(scheduler_pb2.SubmitRequest(request_id="r4"), None, ())
        await accepted([call, untimed])
        deadline = service.deadlines["r3"]
        assert deadline is not None and sent + 4.5 < deadline <= time.monotonic() + 5.0
        assert service.deadlines["r4"] is None
        assert service.metadata["r3"] == {"traceparent": traceparent}


async def test_a_lane_past_its_deadline_fails_here_and_is_aborted_there() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        call = lanes.submit(scheduler_pb2.SubmitRequest(request_id="r5"), 0.3, ())
        await accepted([call])
        with pytest.raises(KvmeshError) as raised:
            await call.read()  # the scripted scheduler never fails it itself
        assert raised.value.reason == Reason.DEADLINE_EXCEEDED
        await until(lambda: service.ended.get("r5") == "closed")


async def test_a_prefill_only_lane_holds_until_the_handover_cancels_it() -> None:
    port = free_port()
    async with scheduler(port) as service, gateway_lanes(port) as lanes:
        call = submit(lanes, "r6")
        await accepted([call])
        ticket = scheduler_pb2.HandoverTicket(worker="w:1", lease_id="r6", num_blocks=2)
        service.queues["r6"].put_nowait(
            Event(finished=scheduler_pb2.SubmitFinished(handover=ticket))
        )
        assert (await call.read()).finished.handover.lease_id == "r6"
        await asyncio.sleep(0.1)
        assert "r6" not in service.ended  # still held
        call.cancel()  # the decode pair has pulled the blocks
        await until(lambda: service.ended.get("r6") == "closed")


async def test_a_lost_scheduler_fails_every_lane_and_a_later_request_opens_a_new_stream() -> None:
    port = free_port()
    async with gateway_lanes(port) as lanes:
        async with scheduler(port):
            calls = [submit(lanes, f"r{i}") for i in range(3)]
            await accepted(calls)
        for call in calls:  # the server stopped with them open
            with pytest.raises(grpc.RpcError) as raised:
                await call.read()
            failure = upstream_failure(raised.value, emitted=False)
            assert (failure.reason, failure.retryable) == (Reason.WORKER_LOST, True)
        async with scheduler(port) as service:
            again = submit(lanes, "r9")
            await accepted([again])
            service.step(finish=True)
            assert list((await again.read()).tokens.token_ids) == [9]


async def test_closing_the_gateways_side_aborts_every_open_request() -> None:
    port = free_port()
    async with scheduler(port) as service:
        async with gateway_lanes(port) as lanes:
            await accepted([submit(lanes, f"r{i}") for i in range(4)])
        await until(lambda: len(service.ended) == 4)
        assert set(service.ended.values()) == {"closed"}
        assert not service.queues

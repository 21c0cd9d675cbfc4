"""The scheduler service's gRPC face: requests in, each request's events back out.

A thin servicer over the step loop (step_loop.py): a request, on a Submit call of its own or a
lane of a SubmitLanes stream (submit_lanes.py), is admitted into the loop and its queue is
streamed; a caller that goes away aborts its request, freeing its blocks at once.
Refusals raise KvmeshError; the server's error boundary turns them into the rich status.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import grpc

from services.scheduler.fair_share import queues_past_bound
from services.scheduler.handover import Handover
from services.scheduler.load_report import LoadReporter
from services.scheduler.request_trace import CANCEL_TO_FREED, RequestTrace
from services.scheduler.step_loop import StepLoop
from services.scheduler.submit_lanes import LaneStream, LaneWriter
from services.scheduler.tracked import Tracked
from shared.block_hash import hash_full_blocks
from shared.codec import sampling_from_pb
from shared.config import HandoverConfig, SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason
from shared.pb.kvmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.runtime.logs import bind_request
from shared.runtime.service import ServiceRuntime

log = logging.getLogger("kvmesh.scheduler")
# A request expires this long before its gRPC deadline, so its `failed` event still reaches the
# client (two more hops) before the client's own deadline fires. Loopback hops take a
# millisecond, but a busy host leaves a process unscheduled for tens of milliseconds: 25 ms
# lost that race in CI, and the client saw a bare DEADLINE_EXCEEDED status instead.
DEADLINE_MARGIN_S = 0.1


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        runtime: ServiceRuntime,
        config: SchedulerConfig,
        enable_prefix_caching: bool,
        worker_address: str,
        max_waiting: int,
        handover: HandoverConfig | None = None,
    ) -> None:
        self.runtime = runtime
        self.max_waiting = max_waiting
        self.loop = StepLoop(config, enable_prefix_caching, worker_address, runtime.set_ready)
        handover = handover or HandoverConfig(worker_advertise=worker_address)
        self.handover = Handover(handover, self.loop)
        self.loop.link.fail_handovers = self.handover.config.load_failure == "fail"
        self.reporter = LoadReporter(self.loop, max_waiting)

    async def _tier_blocks(
        self,
        request: scheduler_pb2.SubmitRequest,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        accepted: scheduler_pb2.SubmitAccepted,
    ) -> int:
        """Leading blocks of its prompt the worker can load (asked before it queues): pulled
        from its prefill worker when handed over, else what the worker's KV tiers hold."""
        link, scheduler = self.loop.link, self.loop.scheduler
        handed_over = request.HasField("handover")
        if scheduler is None or not (link.tiers.enabled or handed_over):
            return 0
        salt = request.cache_salt
        hashes = hash_full_blocks(list(request.token_ids), scheduler.block_size, salt)
        if not handed_over:
            return await link.lookup_blocks(hashes)
        pulled = await self.handover.pull(request, hashes, metadata)
        accepted.handover_blocks, accepted.handover_bytes = pulled.num_blocks, pulled.bytes
        accepted.handover_seconds, accepted.handover_outcome = pulled.seconds, pulled.outcome
        return int(pulled.num_blocks)

    def _admit(
        self,
        request: scheduler_pb2.SubmitRequest,
        remaining: float | None,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        tier_blocks: int = 0,
    ) -> tuple[Tracked, int]:
        """Queues the request (its sampling decoded once here: the gateway validated it);
        returns it tracked and its place in the queue."""
        self.runtime.refuse_if_draining()
        loop, scheduler = self.loop, self.loop.scheduler
        if scheduler is None or not loop.worker_ready:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                "no serving engine-worker attached (not yet, lost or draining)",
                retryable=True,
                retry_after_ms=1000,
            )
        if remaining is not None and remaining <= DEADLINE_MARGIN_S:
            raise KvmeshError(
                Reason.DEADLINE_EXCEEDED, "the deadline leaves no time to start", retryable=True
            )
        num_waiting = len(scheduler.waiting)
        if num_waiting >= self.max_waiting and not queues_past_bound(
            request.tenant,
            request.tenant_weight if request.tenant_weight > 0 else 1.0,
            scheduler.waiting,
            scheduler.running,
            self.max_waiting,
        ):
            drain_s = loop.queue_estimate.queue_time_s(num_waiting - self.max_waiting, 0)
            raise KvmeshError(
                Reason.OVERLOADED,
                f"{num_waiting} requests are already queued (the bound is {self.max_waiting})",
                retryable=True,
                retry_after_ms=max(100, round(drain_s * 1e3)),
            )
        if request.request_id in loop.tracked:
            raise KvmeshError(Reason.INVALID_ARGUMENT, f"{request.request_id!r} is in use")
        added = scheduler.add_request(
            request.request_id,
            list(request.token_ids),
            sampling_from_pb(request.sampling),
            request.priority,
            cache_salt=request.cache_salt,
            tenant=request.tenant,
            tenant_weight=request.tenant_weight,
            group_id=request.group_id,
            num_tier_blocks=tier_blocks,
        )
        added.prefill_only, added.handed_over = request.prefill_only, request.HasField("handover")
        trace = RequestTrace(
            metadata, request.request_id, len(request.token_ids), request.tenant, self.loop.tally
        )
        tracked = Tracked(request.request_id, trace)
        if remaining is not None:
            loop.expire_later(tracked, remaining - DEADLINE_MARGIN_S)
        loop.tracked[request.request_id] = tracked
        return tracked, scheduler.waiting.index(scheduler.requests[request.request_id])

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        events = self.events(request, deadline, context.invocation_metadata())
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def SubmitLanes(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.SubmitLanesRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.SubmitLanesResponse]:
        replies = LaneStream(self.events).replies(request_iterator)
        async with contextlib.aclosing(replies):
            async for reply in replies:
                yield reply

    async def events(
        self,
        request: scheduler_pb2.SubmitRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        lane: LaneWriter | None = None,
    ) -> AsyncGenerator[scheduler_pb2.SubmitEvent, None]:
        """One request's events, whether its stream is a Submit call or a lane: accepted, its
        tokens, one terminal. A refusal raises KvmeshError before `accepted`; closing the
        iterator early aborts the request. `deadline` is on the monotonic clock. On a `lane`,
        tokens after `accepted` are written there instead of being yielded."""
        bind_request(request.request_id)

        def remaining() -> float | None:
            return None if deadline is None else deadline - time.monotonic()

        if request.sampling.HasField("response_format"):
            await self.loop.link.prepare_format(request.sampling.response_format, remaining())
        accepted = scheduler_pb2.SubmitAccepted()
        tier_blocks = await self._tier_blocks(request, metadata, accepted)
        tracked, accepted.queue_position = self._admit(request, remaining(), metadata, tier_blocks)
        self.loop.wake()
        with self.runtime.in_flight():
            try:
                yield scheduler_pb2.SubmitEvent(accepted=accepted)
                # Resumed right after the lane posted `accepted`, with no step in between.
                tracked.lane = lane
                while True:
                    event = await tracked.events.get()
                    kind = event.WhichOneof("event")
                    ticket = None
                    if kind == "finished":
                        event.finished.worker = self.handover.config.worker_advertise
                        ticket = self.handover.ticket(request.request_id)
                    if ticket is not None:
                        event.finished.handover.CopyFrom(ticket)
                    yield event
                    if ticket is not None:  # its blocks wait for the decode pair's pull
                        await self.handover.hold(request.request_id)
                    if kind in ("finished", "failed"):
                        return
            finally:
                if request.request_id in self.loop.tracked:  # the caller went away first
                    self._caller_left(tracked)

    def _caller_left(self, tracked: Tracked) -> None:
        noticed = time.monotonic()
        self.loop.forget(tracked)
        if self.loop.abort(tracked.request_id):
            CANCEL_TO_FREED.observe(time.monotonic() - noticed)
            tracked.trace.cancelled("caller")
            self.loop.counters.aborted += 1
            log.info("cancelled by caller")
        tracked.trace.ended("cancelled", "caller", tracked.output_tokens)

    async def Abort(
        self, request: scheduler_pb2.SchedulerAbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerAbortResponse:
        tracked = self.loop.tracked.get(request.request_id)
        noticed = time.monotonic()
        found = self.loop.abort(request.request_id)
        if found:
            CANCEL_TO_FREED.observe(time.monotonic() - noticed)
            self.loop.counters.aborted += 1
            if tracked is not None:
                tracked.trace.cancelled("abort")
                self.loop.finish(tracked, FinishReason.FINISH_REASON_ABORT, 0, time.monotonic())
        return scheduler_pb2.SchedulerAbortResponse(found=found)

    async def GetLoad(
        self, request: scheduler_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LoadReport:
        return self.reporter.report(request.include_recent_frees)

    async def GetModel(
        self, request: scheduler_pb2.SchedulerModelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        if self.loop.model is None:
            raise KvmeshError(
                Reason.MODEL_NOT_READY, "no engine-worker attached yet", retryable=True
            )
        model = common_pb2.ModelInfo()
        model.CopyFrom(self.loop.model)
        model.serving_role = self.handover.config.role
        return model

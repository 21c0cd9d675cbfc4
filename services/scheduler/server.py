"""The scheduler service: Submit streams in, one step loop driving the engine-worker.

Each step: `Scheduler.schedule()` -> one StepPlan message to the worker -> its StepResult ->
`Scheduler.update()` -> one SubmitEvent per request that gained tokens. Aborts (Abort calls,
cancelled Submit streams) and deadline expiries free KV blocks at once, between steps; the
worker forgets those requests with the next plan.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.scheduler.queue_estimate import QueueTimeEstimator
from services.scheduler.request_trace import (
    CANCEL_TO_FREED,
    RequestTrace,
    terminal_outcome,
    trace_plan,
)
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_link import (
    WorkerDrained,
    WorkerLink,
    WorkerLost,
    worker_lost_error,
)
from shared import grpc_errors
from shared.codec import logprobs_to_pb, plan_to_pb, result_from_pb, sampling_from_pb
from shared.config import CacheConfig, SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.logs import bind_request
from shared.outputs import FinishReason, RequestOutput
from shared.pb.kvmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.service import ServiceRuntime

log = logging.getLogger("kvmesh.scheduler")
# A request expires this long before its gRPC deadline, so its `failed` event still reaches the
# client (two more hops) before the client's own deadline fires.
DEADLINE_MARGIN_S = 0.025
RECENT_FREES = 1024
_FINISH_REASONS = {
    FinishReason.STOP: scheduler_pb2.SCHEDULER_FINISH_REASON_STOP,
    FinishReason.LENGTH: scheduler_pb2.SCHEDULER_FINISH_REASON_LENGTH,
    FinishReason.ABORT: scheduler_pb2.SCHEDULER_FINISH_REASON_ABORT,
}


@dataclass
class Tracked:
    """A request with an open Submit stream."""

    request_id: str
    trace: RequestTrace  # also its arrival, first step and first token times
    events: asyncio.Queue[scheduler_pb2.SubmitEvent] = field(default_factory=asyncio.Queue)
    output_tokens: int = 0
    timer: asyncio.TimerHandle | None = None


@dataclass
class Counters:
    steps: int = 0
    worker_compute_ms: float = 0.0
    aborted: int = 0
    expired_waiting: int = 0
    expired_running: int = 0


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        runtime: ServiceRuntime,
        config: SchedulerConfig,
        enable_prefix_caching: bool,
        worker_address: str,
        max_waiting: int,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.enable_prefix_caching = enable_prefix_caching
        self.max_waiting = max_waiting
        self.link = WorkerLink(worker_address, self._wake_loop)
        self.scheduler: Scheduler | None = None
        self.model: common_pb2.ModelInfo | None = None
        self.tracked: dict[str, Tracked] = {}
        self.counters = Counters()
        self.queue_estimate = QueueTimeEstimator()
        self.recent_frees: collections.deque[tuple[str, int]] = collections.deque(
            maxlen=RECENT_FREES
        )
        self._wake = asyncio.Event()

    # ---- the step loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Attach to the worker, run steps until it is lost, fail what was in flight, repeat."""
        while True:
            self.model = await self.link.connect()
            block_size = self.model.kv_block_size
            self.scheduler = Scheduler(
                self.config,
                CacheConfig(
                    block_size=block_size, enable_prefix_caching=self.enable_prefix_caching
                ),
                self.model.kv_blocks,
                self.model.max_model_len,
                tuple(self.model.eos_token_ids),
            )
            await self.runtime.set_ready(True)
            try:
                await self._step_until_lost(self.scheduler)
            except WorkerLost as lost:
                await self.runtime.set_ready(False)
                self._fail_all(str(lost))
                self.scheduler = None
                await self.link.close()
            except WorkerDrained:
                log.info("worker drained: released it; waiting for a worker to serve again")
                self.scheduler = None
                await self.link.close()

    async def _step_until_lost(self, scheduler: Scheduler) -> None:
        drain_announced = False
        while True:
            if self.link.lost:
                raise WorkerLost(self.link.address)
            if self.link.draining:
                if not drain_announced:
                    await self.runtime.set_ready(False)  # the gateway routes elsewhere
                    drain_announced = True
                if not scheduler.has_unfinished():
                    raise WorkerDrained(self.link.address)
            self._wake.clear()  # before schedule(): a submission from here on wakes us again
            full = bool(scheduler.waiting) or len(scheduler.running) >= self.config.max_num_seqs
            self.queue_estimate.observe(
                time.monotonic(), full, scheduler.num_finished, bool(scheduler.running)
            )
            plan = scheduler.schedule()
            if plan.num_scheduled_tokens == 0:
                if plan.finished_request_ids:  # let the worker forget them now
                    await self.link.step(plan_to_pb(plan))
                if not scheduler.has_unfinished():
                    await self._wake.wait()
                else:  # nothing fits now; an abort or expiry will free room
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                continue
            plan_pb = plan_to_pb(plan)
            trace_plan(plan, plan_pb, scheduler.requests, self._trace_of)
            result_pb = await self.link.step(plan_pb)
            self.counters.steps += 1
            self.counters.worker_compute_ms += result_pb.compute_ms
            result = result_from_pb(result_pb)
            self._dispatch(scheduler.update(plan, result))

    def _trace_of(self, request_id: str) -> RequestTrace | None:
        tracked = self.tracked.get(request_id)
        return None if tracked is None else tracked.trace

    def _wake_loop(self) -> None:
        self._wake.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            tracked = self.tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.new_token_ids:
                tracked.output_tokens += len(output.new_token_ids)
                if tracked.trace.first_token_at is None:
                    tracked.trace.first_token(now)
                tokens = scheduler_pb2.SubmitTokens(
                    token_ids=output.new_token_ids,
                    logprobs=[logprobs_to_pb(lp) for lp in output.logprobs],
                )
                tracked.events.put_nowait(scheduler_pb2.SubmitEvent(tokens=tokens))
            if output.finish_reason is not None:
                self._finish(tracked, output.finish_reason, output.num_cached_tokens, now)

    def _finish(
        self, tracked: Tracked, reason: FinishReason, cached_tokens: int, now: float
    ) -> None:
        if reason != FinishReason.ABORT:
            self.queue_estimate.finished(tracked.output_tokens)
        trace = tracked.trace
        first_step = trace.scheduled_at or now
        first_token = trace.first_token_at or now
        finished = scheduler_pb2.SubmitFinished(
            finish_reason=_FINISH_REASONS[reason],
            cached_tokens=cached_tokens,
            queue_ms=(first_step - trace.arrival) * 1e3,
            prefill_ms=(first_token - first_step) * 1e3,
            decode_ms=(now - first_token) * 1e3,
        )
        self._close(tracked, scheduler_pb2.SubmitEvent(finished=finished))

    def _close(self, tracked: Tracked, terminal: scheduler_pb2.SubmitEvent) -> None:
        self._forget(tracked)
        outcome, reason = terminal_outcome(terminal)
        cached = terminal.finished.cached_tokens
        tracked.trace.ended(outcome, reason, tracked.output_tokens, cached)
        tracked.events.put_nowait(terminal)

    def _forget(self, tracked: Tracked) -> None:
        if tracked.timer is not None:
            tracked.timer.cancel()
        self.tracked.pop(tracked.request_id, None)

    def _fail_all(self, detail: str) -> None:
        """Every open request fails with WORKER_LOST; only those that emitted no token are
        safe for a client to resend as they are."""
        for tracked in list(self.tracked.values()):
            error = worker_lost_error(detail, emitted_tokens=tracked.output_tokens > 0)
            self._close(tracked, scheduler_pb2.SubmitEvent(failed=grpc_errors.to_pb(error)))

    # ---- aborts and deadlines --------------------------------------------------------------

    def _abort(self, request_id: str) -> bool:
        """Frees the request's blocks now; False when it already finished."""
        if self.scheduler is None or self.scheduler.abort(request_id) is None:
            return False
        self.recent_frees.append((request_id, time.time_ns()))
        self._wake.set()  # the next plan tells the worker to forget it
        return True

    def _expire(self, request_id: str) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None or self.scheduler is None:
            return
        started = tracked.trace.scheduled_at is not None
        if not self._abort(request_id):
            return
        tracked.trace.cancelled("deadline")
        if started:
            self.counters.expired_running += 1
            error = KvmeshError(Reason.DEADLINE_EXCEEDED, "the deadline passed while generating")
        else:
            self.counters.expired_waiting += 1
            error = KvmeshError(
                Reason.DEADLINE_EXCEEDED,
                "the deadline passed before the request could start; nothing was computed",
                retryable=True,
            )
        log.info("deadline exceeded", extra={"request_id": request_id, "started": started})
        self._close(tracked, scheduler_pb2.SubmitEvent(failed=grpc_errors.to_pb(error)))

    # ---- RPCs ------------------------------------------------------------------------------

    def _admit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> Tracked:
        remaining = context.time_remaining()
        self.runtime.refuse_if_draining()
        if self.scheduler is None or self.link.lost or self.link.draining:
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
        num_waiting = len(self.scheduler.waiting)
        if num_waiting >= self.max_waiting:
            drain_s = self.queue_estimate.queue_time_s(num_waiting - self.max_waiting, 0)
            raise KvmeshError(
                Reason.OVERLOADED,
                f"{num_waiting} requests are already queued (the bound is {self.max_waiting})",
                retryable=True,
                retry_after_ms=max(100, round(drain_s * 1e3)),
            )
        if request.request_id in self.tracked:
            raise KvmeshError(Reason.INVALID_ARGUMENT, f"{request.request_id!r} is in use")
        sampling = sampling_from_pb(request.sampling)
        self.scheduler.add_request(
            request.request_id,
            list(request.token_ids),
            sampling,
            request.priority,
            cache_salt=request.cache_salt,
        )
        trace = RequestTrace(
            context.invocation_metadata(),
            request.request_id,
            len(request.token_ids),
            request.tenant,
        )
        tracked = Tracked(request.request_id, trace)
        if remaining is not None:
            loop = asyncio.get_running_loop()
            tracked.timer = loop.call_later(
                remaining - DEADLINE_MARGIN_S, self._expire, request.request_id
            )
        self.tracked[request.request_id] = tracked
        return tracked

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        bind_request(request.request_id)
        try:
            if request.sampling.HasField("response_format"):
                remaining = context.time_remaining()
                await self.link.prepare_format(request.sampling.response_format, remaining)
            tracked = self._admit(request, context)
        except KvmeshError as error:
            log.info("refused", extra={"reason": error.reason.value, "error": error.message})
            await grpc_errors.abort(context, error)
            return
        assert self.scheduler is not None
        queued = self.scheduler.requests[request.request_id]
        position = self.scheduler.waiting.index(queued)
        self._wake.set()
        with self.runtime.in_flight():
            try:
                yield scheduler_pb2.SubmitEvent(
                    accepted=scheduler_pb2.SubmitAccepted(queue_position=position)
                )
                while True:
                    event = await tracked.events.get()
                    yield event
                    if event.WhichOneof("event") in ("finished", "failed"):
                        return
            finally:
                if request.request_id in self.tracked:  # the caller went away first
                    noticed = time.monotonic()
                    self._forget(tracked)
                    if self._abort(request.request_id):
                        CANCEL_TO_FREED.observe(time.monotonic() - noticed)
                        tracked.trace.cancelled("caller")
                        self.counters.aborted += 1
                        log.info("cancelled by caller")
                    tracked.trace.ended("cancelled", "caller", tracked.output_tokens)

    async def Abort(
        self, request: scheduler_pb2.SchedulerAbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerAbortResponse:
        tracked = self.tracked.get(request.request_id)
        noticed = time.monotonic()
        found = self._abort(request.request_id)
        if found:
            CANCEL_TO_FREED.observe(time.monotonic() - noticed)
            self.counters.aborted += 1
            if tracked is not None:
                tracked.trace.cancelled("abort")
                self._finish(tracked, FinishReason.ABORT, 0, time.monotonic())
        return scheduler_pb2.SchedulerAbortResponse(found=found)

    async def GetLoad(
        self, request: scheduler_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LoadReport:
        return self.load_report(request.include_recent_frees)

    def load_report(self, include_recent_frees: bool = False) -> scheduler_pb2.LoadReport:
        report = scheduler_pb2.LoadReport(
            num_steps=self.counters.steps,
            worker_compute_ms=self.counters.worker_compute_ms,
            num_aborted=self.counters.aborted,
            num_expired_waiting=self.counters.expired_waiting,
            num_expired_running=self.counters.expired_running,
            worker_ready=self.scheduler is not None and not (self.link.lost or self.link.draining),
            max_waiting=self.max_waiting,
            num_open_streams=len(self.tracked),
        )
        if self.scheduler is not None:
            load = self.scheduler.load()
            report.num_waiting = load.num_waiting
            report.num_waiting_tokens = load.num_waiting_tokens
            free_slots = self.config.max_num_seqs - load.num_running
            releases = self.queue_estimate.slot_releases_s(
                (r.num_output_tokens, r.sampling.max_tokens) for r in self.scheduler.running
            )
            queue_s = self.queue_estimate.queue_time_s(load.num_waiting, free_slots, releases)
            report.queue_time_estimate_ms = queue_s * 1e3
            report.slot_releases_s.extend(releases)
            report.num_running = load.num_running
            report.num_free_blocks = load.num_free_blocks
            report.num_blocks = load.num_blocks
            report.num_blocks_referenced = load.num_blocks - load.num_free_blocks
            report.num_preemptions = load.num_preemptions
            report.prefix_hit_tokens = load.prefix_hit_tokens
        if include_recent_frees:
            report.recent_frees.extend(
                scheduler_pb2.FreedRequest(request_id=r, freed_unix_ns=t)
                for r, t in self.recent_frees
            )
        return report

    async def GetModel(
        self, request: scheduler_pb2.SchedulerModelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        if self.model is None:
            error = KvmeshError(
                Reason.MODEL_NOT_READY, "no engine-worker attached yet", retryable=True
            )
            await grpc_errors.abort(context, error)
        assert self.model is not None
        return self.model

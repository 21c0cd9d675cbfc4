"""The scheduler's step loop: one StepPlan to the engine-worker per step, tokens out per request.

Each step: `Scheduler.schedule()` -> one StepPlan message to the worker -> its StepResult ->
`Scheduler.update()` -> each request's new tokens (with `--stream-interval N`, once it holds N)
written into its lane's outbox, or its queue on a Submit call. Aborts and deadline expiries free
KV blocks at once, between steps; the worker forgets them with the next plan. No servicer lives
here: server.py admits requests into this loop and streams their events back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from services.scheduler.queue_estimate import QueueTimeEstimator
from services.scheduler.request_trace import RequestTrace, StepTally, terminal_outcome, trace_plan
from services.scheduler.scheduler import Scheduler
from services.scheduler.step_limits import check_step_limits
from services.scheduler.step_pipeline import StepPipeline, plans_ahead
from services.scheduler.tracked import Counters, Tracked
from services.scheduler.worker_link import (
    WorkerDrained,
    WorkerLink,
    WorkerLost,
    worker_lost_error,
)
from shared import grpc_errors
from shared.codec import logprobs_to_pb, plan_to_pb
from shared.config import CacheConfig, SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason, RequestOutput
from shared.pb.kvmesh.v1 import common_pb2, engine_worker_pb2, scheduler_pb2
from shared.sliding_window import window_pool_of
from shared.step import FailedRequest, StepPlan

log = logging.getLogger("kvmesh.scheduler")
IDLE_POLL_S = 0.05  # nothing fits now: an abort or expiry will free room
FAILURE_MESSAGES = {  # what a client is told of a request the worker could not compute
    Reason.KV_HANDOVER_FAILED: "its prefilled blocks did not load whole (--kv-load-failure fail)",
    Reason.INVALID_SAMPLING_PARAMS: "its sampling parameters left no finite probability to "
    "sample from; it was stopped and its batch went on",
    Reason.INVALID_SCHEMA: "its response format's grammar could go no further",
    None: "the engine could not compute this request; it was stopped and its batch went on",
}


class StepLoop:
    def __init__(
        self,
        config: SchedulerConfig,
        enable_prefix_caching: bool,
        worker_address: str,
        set_ready: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.config = config
        self.enable_prefix_caching = enable_prefix_caching
        self.set_ready = set_ready  # this scheduler's readiness follows its worker's
        self.link = WorkerLink(worker_address, self.wake)
        self.scheduler: Scheduler | None = None
        self.model: common_pb2.ModelInfo | None = None
        self.tracked: dict[str, Tracked] = {}
        self.counters = Counters()
        self.tally = StepTally()  # every request trace's decode steps
        self.queue_estimate = QueueTimeEstimator()
        self.recent_frees: collections.deque[tuple[str, int]] = collections.deque(maxlen=1024)
        self._wake = asyncio.Event()

    @property
    def worker_ready(self) -> bool:
        return self.scheduler is not None and not (self.link.lost or self.link.draining)

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Attach to the worker, run steps until it is lost, fail what was in flight, repeat."""
        while True:
            self.model = await self.link.connect()
            check_step_limits(self.config, self.model, self.link.address)
            cache = CacheConfig(
                block_size=self.model.kv_block_size,
                enable_prefix_caching=self.enable_prefix_caching,
            )
            self.scheduler = Scheduler(
                self.config,
                cache,
                self.model.kv_blocks,
                self.model.max_model_len,
                tuple(self.model.eos_token_ids),
                self.link.tiers,
                window_pool_of(self.model),
            )
            await self.set_ready(True)
            try:
                await self._step_until_lost(self.scheduler)
            except WorkerLost as lost:
                await self.set_ready(False)
                # The address and gRPC's detail go to this log, never to a client.
                log.warning("worker lost", extra={"detail": str(lost), "open": len(self.tracked)})
                self._fail_all()
            except WorkerDrained:
                log.info("worker drained: released it; waiting for a worker to serve again")
            self.scheduler = None
            await self.link.close()

    async def _step_until_lost(self, scheduler: Scheduler) -> None:
        drain_announced = False
        ahead = plans_ahead(self.config, self.model.device if self.model else "cpu")
        pipeline = StepPipeline(self.link, scheduler, ahead, self._settled)
        while True:
            if self.link.lost:
                raise WorkerLost(self.link.address)
            if self.link.draining:
                if not drain_announced:
                    await self.set_ready(False)  # the gateway routes elsewhere
                    drain_announced = True
                if not scheduler.has_unfinished() and not pipeline.sent:
                    raise WorkerDrained(self.link.address)
            self._wake.clear()  # before schedule(): a submission from here on wakes us again
            full = bool(scheduler.waiting) or len(scheduler.running) >= self.config.max_num_seqs
            self.queue_estimate.observe(
                time.monotonic(), full, scheduler.num_finished, bool(scheduler.running)
            )
            plan = scheduler.schedule()
            if plan.num_scheduled_tokens == 0:
                # Let the worker forget them now, and write down the last blocks that filled
                # (an idle worker has no next step to carry them).
                if plan.finished_request_ids or plan.block_writes:
                    await pipeline.send(plan, plan_to_pb(plan))
                if pipeline.sent:  # nothing new to plan until a step comes back
                    await pipeline.settle_oldest()
                elif not scheduler.has_unfinished():
                    await self._wake.wait()
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                continue
            plan_pb = plan_to_pb(plan)
            started = trace_plan(plan, plan_pb, scheduler.requests, self._trace_of, self.tally)
            await pipeline.send(plan, plan_pb, started)
            await pipeline.after_send()

    def _settled(
        self, outputs: list[RequestOutput], result: engine_worker_pb2.StepResult, plan: StepPlan
    ) -> None:
        if plan.num_scheduled_tokens:
            self.counters.steps += 1
            self.counters.worker_compute_ms += result.compute_ms
        self._dispatch(outputs)

    def _trace_of(self, request_id: str) -> RequestTrace | None:
        tracked = self.tracked.get(request_id)
        return None if tracked is None else tracked.trace

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        interval = self.config.stream_interval
        for output in outputs:
            tracked = self.tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.new_token_ids:
                tracked.output_tokens += len(output.new_token_ids)
                plain = not output.logprobs and not output.prompt_logprobs
                if plain and tracked.trace.first_token_at is not None:
                    tracked.hold_plain(output.new_token_ids, interval)
                else:
                    tokens = scheduler_pb2.SubmitTokens(
                        token_ids=output.new_token_ids,
                        logprobs=[logprobs_to_pb(lp) for lp in output.logprobs],
                        prompt_logprobs=[logprobs_to_pb(lp) for lp in output.prompt_logprobs],
                    )
                    if tracked.trace.first_token_at is None:
                        tracked.trace.first_token(now)
                        tokens.first.CopyFrom(self._first_token_timings(tracked, output, now))
                    tracked.hold(tokens, interval)
            if output.finish_reason is not None:
                self.finish(tracked, output.finish_reason, output.num_cached_tokens, now, output)
            elif output.failure is not None:
                self.fail_execution(tracked, output.failure)

    def _first_token_timings(
        self, tracked: Tracked, output: RequestOutput, now: float
    ) -> scheduler_pb2.FirstTokenTimings:
        trace = tracked.trace
        first_step = trace.scheduled_at or now
        request = self.scheduler.requests.get(output.request_id) if self.scheduler else None
        return scheduler_pb2.FirstTokenTimings(
            queue_ms=(first_step - trace.arrival) * 1e3,
            prefill_ms=(now - first_step) * 1e3,
            cached_tokens=request.num_cached_tokens if request else output.num_cached_tokens,
            loaded_tokens=request.num_loaded_tokens if request else output.num_loaded_tokens,
        )

    def fail_execution(self, tracked: Tracked, failure: FailedRequest) -> None:
        """The worker could not compute it. Not retryable: sent again (here or to another
        worker) it would fail again."""
        self.counters.failed_execution += 1
        log.warning(
            "request failed in the engine",
            extra={
                "request_id": tracked.request_id,
                "reason": failure.reason,
                "error_type": failure.error_type,
            },
        )
        tracked.trace.span.set_attribute("error.type", failure.error_type)
        reason = Reason(failure.reason)
        error = KvmeshError(reason, FAILURE_MESSAGES.get(reason, FAILURE_MESSAGES[None]))
        self._close(tracked, scheduler_pb2.SubmitEvent(failed=grpc_errors.to_pb(error)))

    def finish(
        self,
        tracked: Tracked,
        reason: FinishReason,
        cached_tokens: int,
        now: float,
        output: RequestOutput | None = None,
    ) -> None:
        if reason != FinishReason.FINISH_REASON_ABORT:
            self.queue_estimate.finished(tracked.output_tokens)
        trace = tracked.trace
        first_step = trace.scheduled_at or now
        first_token = trace.first_token_at or now
        finished = scheduler_pb2.SubmitFinished(
            finish_reason=reason,
            cached_tokens=cached_tokens,
            queue_ms=(first_step - trace.arrival) * 1e3,
            prefill_ms=(first_token - first_step) * 1e3,
            decode_ms=(now - first_token) * 1e3,
            draft_tokens=output.num_draft_tokens if output else 0,
            accepted_draft_tokens=output.num_accepted_drafts if output else 0,
            loaded_tokens=output.num_loaded_tokens if output else 0,
        )
        if finished.draft_tokens:
            trace.span.set_attributes(
                {
                    "kvmesh.spec.draft_tokens": finished.draft_tokens,
                    "kvmesh.spec.accepted_tokens": finished.accepted_draft_tokens,
                }
            )
        self._close(tracked, scheduler_pb2.SubmitEvent(finished=finished))

    def _close(self, tracked: Tracked, terminal: scheduler_pb2.SubmitEvent) -> None:
        self.forget(tracked)
        outcome, reason = terminal_outcome(terminal)
        cached = terminal.finished.cached_tokens
        tracked.trace.ended(outcome, reason, tracked.output_tokens, cached)
        tracked.send_held()
        tracked.events.put_nowait(terminal)

    def forget(self, tracked: Tracked) -> None:
        if tracked.timer is not None:
            tracked.timer.cancel()
        self.tracked.pop(tracked.request_id, None)

    def _fail_all(self) -> None:
        """Every open request fails with WORKER_LOST; only those that emitted no token are
        safe for a client to resend as they are."""
        for tracked in list(self.tracked.values()):
            error = worker_lost_error(emitted_tokens=tracked.output_tokens > 0)
            self._close(tracked, scheduler_pb2.SubmitEvent(failed=grpc_errors.to_pb(error)))

    def abort(self, request_id: str) -> bool:
        """Frees the request's blocks now; False when it already finished."""
        if self.scheduler is None or self.scheduler.abort(request_id) is None:
            return False
        self.recent_frees.append((request_id, time.time_ns()))
        self._wake.set()  # the next plan tells the worker to forget it
        return True

    def expire_later(self, tracked: Tracked, delay_s: float) -> None:
        loop = asyncio.get_running_loop()
        tracked.timer = loop.call_later(delay_s, self._expire, tracked.request_id)

    def _expire(self, request_id: str) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None or self.scheduler is None:
            return
        started = tracked.trace.planned
        if not self.abort(request_id):
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

"""One request's spans in the scheduler, and the per-request scheduler metrics.

`scheduler.request` (a child of the gateway's span, from the Submit metadata) lasts from
arrival to the terminal event. Its children: `queue` (arrival to the start of its first step)
and `decode` (first token to the end: one span with counters, never one per token; its steps
and mean batch are running totals over the steps run while it decoded, read at its start and
end, so a steady decode row costs the step one attribute check). Prefill
chunks are the engine-worker's spans: the step plan carries this span's traceparent for each
chunk. Preemption and cancellation are events on `scheduler.request`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram

from services.scheduler.request import Request
from shared.outputs import finish_reason_label
from shared.pb.kvmesh.v1 import engine_worker_pb2, scheduler_pb2
from shared.runtime.metrics import REQUEST_SECONDS, TOKEN_SECONDS, exemplar
from shared.runtime.telemetry import context_from_metadata, trace_id_hex, traceparent_of
from shared.step import NewRequestPlan, RunningRequestPlan, StepPlan

tracer = trace.get_tracer("kvmesh.scheduler")
QUEUE_SECONDS = Histogram(
    "kvmesh_queue_time_seconds",
    "Arrival at the scheduler to the start of its first step",
    buckets=REQUEST_SECONDS,
)
PREFILL_SECONDS = Histogram(
    "kvmesh_prefill_time_seconds",
    "Start of its first step to first token (every prefill chunk)",
    buckets=REQUEST_SECONDS,
)
CANCELLATIONS = Counter("kvmesh_cancellations", "Requests ended before finishing", ["cause"])
for _cause in ("caller", "abort", "deadline"):
    CANCELLATIONS.labels(_cause)
CANCEL_TO_FREED = Histogram(
    "kvmesh_cancel_to_freed_seconds",
    "A cancellation noticed (caller gone, Abort, deadline) to its KV blocks freed",
    buckets=TOKEN_SECONDS,
)


class StepTally:
    """Steps planned and their batch sizes summed, since the step loop began."""

    def __init__(self) -> None:
        self.steps = 0
        self.batch_total = 0


class RequestTrace:
    def __init__(
        self,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        request_id: str,
        prompt_tokens: int,
        tenant: str,
        tally: StepTally,  # its step loop's: the decode steps are read from it
    ) -> None:
        self.arrival = time.monotonic()
        self.span = tracer.start_span(
            "scheduler.request",
            context=context_from_metadata(metadata),
            kind=SpanKind.SERVER,
            attributes={
                "kvmesh.request_id": request_id,
                "gen_ai.usage.input_tokens": prompt_tokens,
                "kvmesh.tenant": tenant,
            },
        )
        self.trace_id = trace_id_hex(self.span)
        self.traceparent = traceparent_of(self.span)  # the worker's prefill spans hang here
        self._parent = trace.set_span_in_context(self.span)
        self._queue: trace.Span | None = tracer.start_span("queue", context=self._parent)
        self.planned = False  # in a step's plan
        self.scheduled_at: float | None = None  # the first step holding it began on the worker
        self.first_token_at: float | None = None
        self._decode: trace.Span | None = None
        self._tally = tally
        self.decoding = False  # since a step it was in decoded; until preempted or ended
        self._decoding_from = (0, 0)  # the tally then, the step included
        self._decode_steps = 0
        self._decode_batch_total = 0
        self._prefill_chunks = 0

    def scheduled(self, prefill_chunk: bool) -> bool:
        """The request is in a step's plan; True the first time."""
        first = not self.planned
        self.planned = True
        self._prefill_chunks += prefill_chunk
        return first

    def started(self) -> None:
        """The first step holding it began on the worker: its queue ends. Planned ahead, that
        is when the step in flight before it came back, not when it was planned."""
        if self._queue is not None:
            self.scheduled_at = time.monotonic()
            QUEUE_SECONDS.observe(self.scheduled_at - self.arrival, exemplar(self.trace_id))
            self._queue.end()
            self._queue = None

    def decode_started(self, batch_size: int) -> None:
        """The step just tallied holds it decoding."""
        self.decoding = True
        tally = self._tally
        self._decoding_from = (tally.steps - 1, tally.batch_total - batch_size)

    def _decode_stopped(self) -> None:
        if self.decoding:
            self.decoding = False
            steps, batch_total = self._decoding_from
            self._decode_steps += self._tally.steps - steps
            self._decode_batch_total += self._tally.batch_total - batch_total

    def first_token(self, now: float) -> None:
        self.first_token_at = now
        if self.scheduled_at is not None:
            PREFILL_SECONDS.observe(now - self.scheduled_at, exemplar(self.trace_id))
        self._decode = tracer.start_span("decode", context=self._parent)

    def preempted(self) -> None:
        self._decode_stopped()  # its recomputation is prefill
        self.span.add_event("preempted")

    def cancelled(self, cause: str) -> None:
        CANCELLATIONS.labels(cause).inc()
        self.span.add_event("cancelled", {"kvmesh.cancel.cause": cause})

    def ended(self, outcome: str, reason: str, output_tokens: int, cached_tokens: int = 0) -> None:
        self._decode_stopped()
        if self._queue is not None:  # never scheduled (expired, cancelled or failed waiting)
            self._queue.end()
            self._queue = None
        if self._decode is not None:
            self._decode.set_attributes(
                {
                    "gen_ai.usage.output_tokens": output_tokens,
                    "kvmesh.decode.steps": self._decode_steps,
                    "kvmesh.batch_size.mean": self._decode_batch_total / max(1, self._decode_steps),
                }
            )
            self._decode.end()
            self._decode = None
        self.span.set_attributes(
            {
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.response.finish_reasons": [reason],
                "kvmesh.prefix_hit_tokens": cached_tokens,
                "kvmesh.prefill.chunks": self._prefill_chunks,
                "kvmesh.outcome": outcome,
            }
        )
        if outcome == "failed":
            self.span.set_status(Status(StatusCode.ERROR, reason))
        self.span.end()


def trace_plan(
    plan: StepPlan,
    plan_pb: engine_worker_pb2.StepPlan,
    requests: Mapping[str, Request],
    trace_of: Callable[[str], RequestTrace | None],
    tally: StepTally,
) -> Callable[[], None]:
    """First scheduling, decode starts and preemptions into each request's trace, the step
    into `tally` (its traces'); prefill chunks of traced requests into the plan, for the
    worker to record as spans. Returns what to call when the step begins on the worker: the
    first step of a request ends its queue."""
    first_scheduled: list[RequestTrace] = []
    for request_id in plan.finished_request_ids:
        trace = trace_of(request_id)
        if trace is not None and request_id in requests:  # preempted, not done
            trace.preempted()
    batch_size = len(plan.new_requests) + len(plan.running_requests)
    tally.steps += 1
    tally.batch_total += batch_size
    scheduled: list[NewRequestPlan | RunningRequestPlan] = [
        *plan.new_requests,
        *plan.running_requests,
    ]
    for item in scheduled:
        trace = trace_of(item.request_id)
        if trace is None or trace.decoding:
            continue  # a steady decode row: the tally counts its step
        request = requests.get(item.request_id)
        if request is None:
            continue
        # Prompt chunks, and the recomputation of a preempted request, are prefill (tokens a
        # step planned ahead will sample count as known).
        known = request.num_tokens + request.num_pending_tokens
        prefill = known == request.prompt_len or request.num_computed_tokens < known - 1
        if trace.scheduled(prefill):
            first_scheduled.append(trace)
        if not prefill:
            trace.decode_started(batch_size)
        elif trace.traceparent:
            plan_pb.prefill_traces.add(
                request_id=item.request_id,
                traceparent=trace.traceparent,
                chunk_tokens=item.num_scheduled_tokens,
                cached_tokens=request.num_cached_tokens,
                start_position=request.num_computed_tokens,
            )
    return functools.partial(start_traces, first_scheduled)


def start_traces(traces: Sequence[RequestTrace]) -> None:
    for request in traces:
        request.started()


def terminal_outcome(terminal: scheduler_pb2.SubmitEvent) -> tuple[str, str]:
    """(outcome, reason) of a terminal event, for the trace."""
    if terminal.WhichOneof("event") == "failed":
        return "failed", terminal.failed.reason
    reason = finish_reason_label(terminal.finished.finish_reason)
    return ("cancelled" if reason == "abort" else "completed"), reason

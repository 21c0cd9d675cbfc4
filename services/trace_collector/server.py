"""The trace-collector: an OTLP/gRPC TraceService into a bounded span store, and the
kvmesh.v1.Traces API that answers "where did this request spend its time".

Nothing on the request path waits for it: services export spans in batches from their own
bounded queues, and if the collector is down requests still succeed (their spans are dropped
and counted there).
"""

from __future__ import annotations

import logging
import time

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client import Counter, Gauge

from services.trace_collector.forwarder import OtlpForwarder
from services.trace_collector.phases import PHASES, RequestTiming, request_timing, summarize
from services.trace_collector.span_store import SpanStore, StoredSpan, StoredTrace
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import traces_pb2, traces_pb2_grpc
from shared.tenants import ApiKeys

log = logging.getLogger("kvmesh.trace_collector")
SPANS_RECEIVED = Counter("kvmesh_collector_spans_received", "Spans received over OTLP")
SPANS_EVICTED = Gauge("kvmesh_collector_spans_evicted", "Spans evicted to stay in budget")
STORED_BYTES = Gauge("kvmesh_collector_stored_bytes", "Estimated memory held by stored spans")
STORED_SPANS = Gauge("kvmesh_collector_stored_spans", "Spans held")


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: SpanStore, forwarder: OtlpForwarder | None = None) -> None:
        self.store = store
        self.forwarder = forwarder

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        added = self.store.add(request.resource_spans)
        SPANS_RECEIVED.inc(added)
        SPANS_EVICTED.set(self.store.evicted_spans)
        STORED_BYTES.set(self.store.num_bytes)
        STORED_SPANS.set(self.store.num_spans)
        if self.forwarder is not None:
            self.forwarder.offer(request, added)
        return trace_service_pb2.ExportTraceServiceResponse()


def _text(value: object) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)


def span_to_pb(span: StoredSpan) -> traces_pb2.SpanRecord:
    return traces_pb2.SpanRecord(
        span_id=span.span_id,
        parent_span_id=span.parent_span_id,
        name=span.name,
        service=span.service,
        start_unix_ns=span.start_ns,
        end_unix_ns=span.end_ns,
        attributes={key: _text(value) for key, value in span.attributes.items()},
        events=[traces_pb2.SpanEvent(name=name, time_unix_ns=t) for name, t in span.events],
        error=span.error,
    )


def timing_to_pb(timing: RequestTiming) -> traces_pb2.RequestTiming:
    return traces_pb2.RequestTiming(
        request_id=timing.request_id,
        trace_id=timing.trace_id,
        model=timing.model,
        start_unix_ns=timing.start_ns,
        e2e_ms=timing.e2e_ms,
        ttft_ms=timing.ttft_ms or 0.0,
        tpot_ms=timing.tpot_ms or 0.0,
        queue_ms=timing.queue_ms or 0.0,
        tokenize_ms=timing.tokenize_ms or 0.0,
        prefill_ms=timing.prefill_ms or 0.0,
        decode_ms=timing.decode_ms or 0.0,
        output_tokens=timing.output_tokens,
        outcome=timing.outcome,
        finish_reason=timing.finish_reason,
    )


class TracesService(traces_pb2_grpc.TracesServicer):
    """The queries: every tenant's requests, so with auth on only an admin's key reads them
    (the OTLP intake stays the mesh's own)."""

    def __init__(self, store: SpanStore, api_keys: ApiKeys | None = None) -> None:
        self.store = store
        self.api_keys = api_keys or ApiKeys()

    def _admit(self, context: grpc.aio.ServicerContext) -> None:
        self.api_keys.require_admin(context.invocation_metadata(), "read traces")

    def _timings(self, window_s: float, model: str) -> list[RequestTiming]:
        since_ns = time.time_ns() - round(window_s * 1e9) if window_s > 0 else 0
        timings = []
        for stored in self.store.traces():
            timing = request_timing(stored)
            if timing is None or timing.start_ns < since_ns:
                continue
            if not model or timing.model == model:
                timings.append(timing)
        return timings

    async def GetTrace(
        self, request: traces_pb2.GetTraceRequest, context: grpc.aio.ServicerContext
    ) -> traces_pb2.Trace:
        self._admit(context)
        stored: StoredTrace | None
        if request.WhichOneof("key") == "trace_id":
            stored = self.store.trace(request.trace_id)
        else:
            stored = self.store.trace_of_request(request.request_id)
        if stored is None:
            key = request.trace_id or request.request_id
            raise KvmeshError(
                Reason.TRACE_NOT_FOUND,
                f"no trace for {key!r}: not received yet, evicted, or tracing was off",
                retryable=True,
                retry_after_ms=500,
            )
        timing = request_timing(stored)
        return traces_pb2.Trace(
            trace_id=stored.trace_id,
            request_id=stored.request_id,
            spans=[span_to_pb(s) for s in sorted(stored.spans, key=lambda s: s.start_ns)],
            timing=None if timing is None else timing_to_pb(timing),
        )

    async def GetPhaseStats(
        self, request: traces_pb2.PhaseStatsRequest, context: grpc.aio.ServicerContext
    ) -> traces_pb2.PhaseStats:
        self._admit(context)
        timings = self._timings(request.window_s, request.model)
        accepted = [t for t in timings if t.outcome != "rejected"]
        return traces_pb2.PhaseStats(
            requests=len(accepted),
            rejected=len(timings) - len(accepted),
            phases=[
                traces_pb2.PhasePercentiles(
                    phase=s.phase,
                    count=s.count,
                    p50_ms=s.p50_ms,
                    p95_ms=s.p95_ms,
                    p99_ms=s.p99_ms,
                    max_ms=s.max_ms,
                )
                for s in summarize(accepted)
            ],
        )

    async def ListSlowest(
        self, request: traces_pb2.SlowestRequest, context: grpc.aio.ServicerContext
    ) -> traces_pb2.SlowestResponse:
        self._admit(context)
        phase = request.phase or "e2e"
        if phase not in PHASES or phase == "itl":
            raise KvmeshError(Reason.INVALID_ARGUMENT, f"phase must be one of {PHASES[:-2]}")
        timings = [
            t
            for t in self._timings(request.window_s, request.model)
            if t.outcome != "rejected" and t.phase_ms(phase)
        ]
        timings.sort(key=lambda t: t.phase_ms(phase) or 0.0, reverse=True)
        limit = request.limit or 10
        return traces_pb2.SlowestResponse(requests=[timing_to_pb(t) for t in timings[:limit]])

"""Tracing in every service: OpenTelemetry spans sent to the trace-collector in bounded batches,
and the W3C trace context carried in gRPC metadata so one request is one trace.

The request path never waits on telemetry: a finished span goes into a bounded queue that a
background thread sends in batches over OTLP/gRPC; a full queue or a failed send drops spans and
counts them (`kvmesh_spans_dropped_total`). With no endpoint, tracing is off and every span is
the API's no-op span, which costs a function call.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter

from shared.runtime.tls import sync_channel

log = logging.getLogger("kvmesh.telemetry")
SPANS_DROPPED = Counter(
    "kvmesh_spans_dropped",
    "Finished spans never sent: the export queue was full or the collector did not answer",
    ["cause"],
)
for _cause in ("queue_full", "export_failed"):
    SPANS_DROPPED.labels(_cause)  # exposed as 0 from the start, so a rate() has a baseline
SPANS_EXPORTED = Counter("kvmesh_spans_exported", "Spans the trace-collector accepted")
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = ("traceparent", "tracestate")


class BoundedSpanExporter(SpanProcessor):
    """A bounded queue of finished spans and a thread that exports them in batches.

    Unlike the SDK's BatchSpanProcessor, a send is tried once with a short deadline (a down
    collector costs one timeout per batch, not a retry loop) and every lost span is counted.
    """

    def __init__(
        self,
        endpoint: str,
        max_queue: int = 8192,
        max_batch: int = 512,
        interval_s: float = 0.25,
        timeout_s: float = 1.0,
    ) -> None:
        self.endpoint = endpoint
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._exporting = threading.Lock()
        self._failing = False
        self._channel = sync_channel(endpoint)
        self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        if len(self._queue) >= self.max_queue:
            SPANS_DROPPED.labels("queue_full").inc()
            return
        self._queue.append(span)  # deque appends are atomic: no lock on the request path
        if len(self._queue) >= self.max_batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._export_pending()

    def _export_pending(self) -> None:
        with self._exporting:
            while self._queue:
                size = min(self.max_batch, len(self._queue))
                batch = [self._queue.popleft() for _ in range(size)]
                self._send(batch)

    def _send(self, batch: Sequence[ReadableSpan]) -> None:
        try:
            self._stub.Export(encode_spans(batch), timeout=self.timeout_s)
        except grpc.RpcError as error:
            SPANS_DROPPED.labels("export_failed").inc(len(batch))
            if not self._failing:
                self._failing = True
                log.warning(
                    "trace-collector unreachable: spans are dropped and counted",
                    extra={"endpoint": self.endpoint, "error": error.code().name},
                )
            return
        SPANS_EXPORTED.inc(len(batch))
        if self._failing:
            self._failing = False
            log.info("trace-collector reachable again", extra={"endpoint": self.endpoint})

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        self._export_pending()
        return True

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=2 * self.timeout_s + 1)
        self._export_pending()
        self._channel.close()


def configure_tracing(
    service_name: str, endpoint: str | None, instance: str = ""
) -> TracerProvider | None:
    """Installs the process's tracer provider; None (tracing off) without an endpoint."""
    if not endpoint:
        return None
    resource = Resource.create({"service.name": service_name, "service.instance.id": instance})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BoundedSpanExporter(endpoint))
    trace.set_tracer_provider(provider)
    log.info("tracing on", extra={"endpoint": endpoint})
    return provider


# ---- W3C trace context across hops ----------------------------------------------------------


def context_from_metadata(
    metadata: Sequence[tuple[str, str | bytes]] | None,
) -> otel_context.Context:
    """The caller's trace context (a client's own `traceparent` included); empty if none."""
    carrier = {
        key: value if isinstance(value, str) else value.decode()
        for key, value in metadata or ()
        if key in _TRACE_HEADERS
    }
    return _PROPAGATOR.extract(carrier)


def metadata_for(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes the callee's spans children of `span`."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def traceparent_of(span: trace.Span) -> str:
    """`span`'s context as a W3C traceparent string ("" when tracing is off)."""
    return dict(metadata_for(span)).get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context:
    return _PROPAGATOR.extract({"traceparent": traceparent} if traceparent else {})


def trace_id_hex(span: trace.Span) -> str:
    """The span's trace id as 32 hex digits; "" for a no-op span."""
    span_context = span.get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else ""

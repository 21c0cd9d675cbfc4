"""Spans held by the trace-collector, grouped by trace, within a memory budget.

Spans arrive as OTLP batches from every service, a trace's spans over several batches. They
are kept flattened (`StoredSpan`) under their trace, traces in arrival order; past the budget
the oldest traces go first, whole. A request id (the `kvmesh.request_id` attribute) finds its
trace.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.trace.v1 import trace_pb2

AttributeValue = str | bool | int | float | list
# Per-span overhead beyond its encoded size: the record, dict and list cells.
SPAN_OVERHEAD_BYTES = 600


@dataclass
class StoredSpan:
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue]
    events: list[tuple[str, int]]
    error: bool

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class StoredTrace:
    trace_id: str
    spans: list[StoredSpan] = field(default_factory=list)
    request_id: str = ""  # the client's id (the gateway's spans), else the first seen
    request_ids: set[str] = field(default_factory=set)  # every id it goes by on any hop
    num_bytes: int = 0

    def named(self, name: str) -> Iterator[StoredSpan]:
        return (span for span in self.spans if span.name == name)

    def first(self, name: str) -> StoredSpan | None:
        return next(self.named(name), None)


def _value(value: otlp_common.AnyValue) -> AttributeValue:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind in (None, "kvlist_value", "bytes_value"):
        return str(value) if kind else ""
    return getattr(value, kind)


def _attributes(pairs: Iterable[otlp_common.KeyValue]) -> dict[str, AttributeValue]:
    return {pair.key: _value(pair.value) for pair in pairs}


class SpanStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_spans = 0
        self.evicted_spans = 0
        self._traces: collections.OrderedDict[str, StoredTrace] = collections.OrderedDict()
        self._by_request: dict[str, str] = {}

    def add(self, resource_spans: Iterable[trace_pb2.ResourceSpans]) -> int:
        """Stores every span; returns how many."""
        added = 0
        for resource in resource_spans:
            service = str(_attributes(resource.resource.attributes).get("service.name", ""))
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self._add(span, service)
                    added += 1
        self._evict()
        return added

    def _add(self, span: trace_pb2.Span, service: str) -> None:
        trace_id = span.trace_id.hex()
        stored = self._traces.get(trace_id)
        if stored is None:
            stored = self._traces[trace_id] = StoredTrace(trace_id)
        record = StoredSpan(
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(),
            name=span.name,
            service=service,
            start_ns=span.start_time_unix_nano,
            end_ns=span.end_time_unix_nano,
            attributes=_attributes(span.attributes),
            events=[(event.name, event.time_unix_nano) for event in span.events],
            error=span.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
        )
        stored.spans.append(record)
        size = span.ByteSize() + SPAN_OVERHEAD_BYTES
        stored.num_bytes += size
        self.num_bytes += size
        self.num_spans += 1
        request_id = record.attributes.get("kvmesh.request_id")
        if isinstance(request_id, str) and request_id:
            # A tenant's own id goes upstream scoped by the tenant: both names find the trace.
            if not stored.request_id or service == "gateway":
                stored.request_id = request_id
            stored.request_ids.add(request_id)
            self._by_request[request_id] = trace_id  # a reused id finds its newest trace

    def _evict(self) -> None:
        while self.num_bytes > self.max_bytes and self._traces:
            _, oldest = self._traces.popitem(last=False)
            self.num_bytes -= oldest.num_bytes
            self.num_spans -= len(oldest.spans)
            self.evicted_spans += len(oldest.spans)
            for request_id in oldest.request_ids:
                if self._by_request.get(request_id) == oldest.trace_id:
                    del self._by_request[request_id]

    def trace(self, trace_id: str) -> StoredTrace | None:
        return self._traces.get(trace_id.lower())

    def trace_of_request(self, request_id: str) -> StoredTrace | None:
        trace_id = self._by_request.get(request_id)
        return None if trace_id is None else self._traces.get(trace_id)

    def traces(self) -> Iterator[StoredTrace]:
        return iter(list(self._traces.values()))

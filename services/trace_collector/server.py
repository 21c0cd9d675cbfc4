"""The trace-collector: an OTLP/gRPC TraceService that keeps recent spans in a bounded buffer.

Nothing on the request path waits for it: services export spans in batches, and if the
collector is down requests still succeed. The per-request waterfalls and per-phase
percentiles come with the telemetry work; this is the receiving end.
"""

from __future__ import annotations

import collections
import logging

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

log = logging.getLogger("kvmesh.trace_collector")


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, max_spans: int) -> None:
        self.spans: collections.deque[trace_pb2.Span] = collections.deque(maxlen=max_spans)
        self.received = 0

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
                self.received += len(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

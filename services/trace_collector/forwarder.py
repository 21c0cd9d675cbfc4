"""Forwards every OTLP batch the collector receives to another OTLP/gRPC endpoint (Jaeger, an
OpenTelemetry Collector), from a bounded queue: a slow or absent downstream drops batches and
counts them, never slowing the services that export to us."""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client import Counter

from shared.runtime.tls import aio_channel

log = logging.getLogger("kvmesh.trace_collector")
FORWARD_DROPPED = Counter(
    "kvmesh_collector_forward_dropped_spans", "Spans not forwarded: queue full or send failed"
)


class OtlpForwarder:
    def __init__(self, endpoint: str, max_batches: int = 1024, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._queue: asyncio.Queue[trace_service_pb2.ExportTraceServiceRequest] = asyncio.Queue(
            max_batches
        )
        self._channel = aio_channel(endpoint, token="")  # outside: never the mesh token
        self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)
        self._failing = False

    def offer(self, batch: trace_service_pb2.ExportTraceServiceRequest, num_spans: int) -> None:
        try:
            self._queue.put_nowait(batch)
        except asyncio.QueueFull:
            FORWARD_DROPPED.inc(num_spans)

    async def run(self) -> None:
        while True:
            batch = await self._queue.get()
            try:
                await self._stub.Export(batch, timeout=self.timeout_s)
            except grpc.RpcError as error:
                FORWARD_DROPPED.inc(
                    sum(len(s.spans) for r in batch.resource_spans for s in r.scope_spans)
                )
                if not self._failing:
                    self._failing = True
                    log.warning(
                        "forwarding failed: batches are dropped and counted",
                        extra={"endpoint": self.endpoint, "error": str(error.code())},
                    )
                continue
            if self._failing:
                self._failing = False
                log.info("forwarding again", extra={"endpoint": self.endpoint})

    async def close(self) -> None:
        await self._channel.close()

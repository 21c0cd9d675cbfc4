"""The collector over gRPC: any OTLP exporter's batch is stored, answered through
kvmesh.v1.Traces, and forwarded to a second collector; a dead downstream costs only drops."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from kvmesh.mesh.service_process import free_port
from services.trace_collector.forwarder import FORWARD_DROPPED, OtlpForwarder
from services.trace_collector.server import TraceCollector, TracesService
from services.trace_collector.span_store import SpanStore
from shared.pb.kvmesh.v1 import traces_pb2, traces_pb2_grpc
from tests.trace_collector.test_span_store import recorded_request


async def serve_collector(
    store: SpanStore, forwarder: OtlpForwarder | None = None
) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
        TraceCollector(store, forwarder), server
    )
    traces_pb2_grpc.add_TracesServicer_to_server(TracesService(store), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


async def test_batches_are_stored_queried_and_forwarded() -> None:
    downstream_store = SpanStore(1 << 20)
    downstream, downstream_address = await serve_collector(downstream_store)
    forwarder = OtlpForwarder(downstream_address)
    forwarding = asyncio.create_task(forwarder.run())
    store = SpanStore(1 << 20)
    upstream, address = await serve_collector(store, forwarder)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            otlp = trace_service_pb2_grpc.TraceServiceStub(channel)
            await otlp.Export(encode_spans(recorded_request("fwd-1")))
            trace = await traces_pb2_grpc.TracesStub(channel).GetTrace(
                traces_pb2.GetTraceRequest(request_id="fwd-1")
            )
        assert [s.name for s in trace.spans] == ["kvmesh.Generate", "queue"]
        assert trace.spans[1].parent_span_id == trace.spans[0].span_id
        assert trace.timing.e2e_ms == 80.0 and trace.timing.queue_ms == 5.0
        for _ in range(100):
            if downstream_store.trace_of_request("fwd-1") is not None:
                break
            await asyncio.sleep(0.02)
        forwarded = downstream_store.trace_of_request("fwd-1")
        assert forwarded is not None and forwarded.trace_id == trace.trace_id

        await downstream.stop(None)  # the downstream dies: the next batch is dropped, counted
        dropped_before = FORWARD_DROPPED._value.get()
        async with grpc.aio.insecure_channel(address) as channel:
            otlp = trace_service_pb2_grpc.TraceServiceStub(channel)
            await otlp.Export(encode_spans(recorded_request("fwd-2")), timeout=1)
        for _ in range(200):
            if FORWARD_DROPPED._value.get() > dropped_before:
                break
            await asyncio.sleep(0.02)
        assert FORWARD_DROPPED._value.get() - dropped_before == 2
        assert store.trace_of_request("fwd-2") is not None  # stored here all the same
    finally:
        forwarding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await forwarding
        await forwarder.close()
        await upstream.stop(None)
        await downstream.stop(None)

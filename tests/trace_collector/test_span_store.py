"""The collector's span store (budget, eviction, request index), phase timings, percentiles,
and the services' bounded span export against a collector that is not there."""

from __future__ import annotations

import time

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.trace_collector.phases import percentile, request_timing, summarize
from services.trace_collector.span_store import SpanStore
from shared.runtime.telemetry import (
    SPANS_DROPPED,
    BoundedSpanExporter,
    context_from_metadata,
    metadata_for,
)


def recorded_request(request_id: str, tokens: int = 4) -> list:
    """A gateway-like trace: root with first_token and gaps, and a queue span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    start = time.time_ns()
    root = tracer.start_span("kvmesh.Generate", start_time=start)
    root.set_attribute("kvmesh.request_id", request_id)
    root.set_attribute("gen_ai.request.model", "m")
    root.set_attribute("gen_ai.usage.output_tokens", tokens)
    root.set_attribute("kvmesh.itl_ms", [10.0] * (tokens - 1))
    root.set_attribute("gen_ai.response.finish_reasons", ["length"])
    root.add_event("first_token", timestamp=start + 50_000_000)
    child = tracer.start_span(
        "queue", context=context_from_metadata(metadata_for(root)), start_time=start + 1_000_000
    )
    child.end(end_time=start + 6_000_000)
    root.end(end_time=start + 80_000_000)
    return list(exporter.get_finished_spans())


def test_a_trace_is_found_by_request_id_and_timed() -> None:
    store = SpanStore(max_bytes=1 << 20)
    assert store.add(encode_spans(recorded_request("r1")).resource_spans) == 2
    stored = store.trace_of_request("r1")
    assert stored is not None and store.trace(stored.trace_id) is stored
    timing = request_timing(stored)
    assert timing is not None
    assert timing.e2e_ms == pytest.approx(80.0)
    assert timing.ttft_ms == pytest.approx(50.0)
    assert timing.queue_ms == pytest.approx(5.0)
    assert timing.tpot_ms == pytest.approx(10.0)
    assert timing.finish_reason == "length" and timing.model == "m"
    assert store.trace_of_request("unknown") is None


def test_the_budget_evicts_the_oldest_traces_whole() -> None:
    one = encode_spans(recorded_request("r0")).ByteSize()
    store = SpanStore(max_bytes=5 * (one + 2 * 600))
    for index in range(20):
        store.add(encode_spans(recorded_request(f"r{index}")).resource_spans)
    assert store.num_bytes <= store.max_bytes
    assert store.evicted_spans == 2 * (20 - store.num_spans // 2)
    assert store.trace_of_request("r0") is None  # oldest gone
    assert store.trace_of_request("r19") is not None  # newest kept
    assert all(len(t.spans) == 2 for t in store.traces())  # never half a trace


def test_percentiles_interpolate_like_numpy() -> None:
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 100):
        values = sorted(rng.exponential(30, size).tolist())
        for q in (50, 95, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) == 0.0


def test_summary_pools_inter_token_gaps_across_requests() -> None:
    store = SpanStore(max_bytes=1 << 20)
    for index, tokens in enumerate((3, 5)):
        store.add(encode_spans(recorded_request(f"s{index}", tokens)).resource_spans)
    timings = [request_timing(t) for t in store.traces()]
    phases = {s.phase: s for s in summarize(t for t in timings if t is not None)}
    assert phases["itl"].count == 2 + 4
    assert phases["e2e"].count == 2 and phases["prefill"].count == 0


def test_an_unreachable_collector_drops_and_counts_without_blocking() -> None:
    exporter = BoundedSpanExporter("127.0.0.1:1", max_queue=4, interval_s=60, timeout_s=0.2)
    spans = recorded_request("d1") * 3  # 6 finished spans into a queue of 4
    full_before = SPANS_DROPPED.labels("queue_full")._value.get()
    failed_before = SPANS_DROPPED.labels("export_failed")._value.get()
    for span in spans:
        exporter.on_end(span)
    # The request path never exports (an export to port 1 would have failed and been counted).
    assert SPANS_DROPPED.labels("export_failed")._value.get() == failed_before
    assert SPANS_DROPPED.labels("queue_full")._value.get() - full_before == 2
    exporter.force_flush()
    assert SPANS_DROPPED.labels("export_failed")._value.get() - failed_before == 4
    exporter.shutdown()

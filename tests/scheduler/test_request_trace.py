"""A request's scheduler spans over a real scheduling run with preemption: one request span,
one queue span, one decode span each; preemptions as events; every prompt token's prefill
chunk sent to the worker for its span."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler import request_trace
from services.scheduler.request_trace import RequestTrace, trace_plan
from shared.codec import plan_to_pb
from shared.outputs import finish_reason_label
from shared.sampling import SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import make_scheduler


def test_spans_events_and_prefill_chunks_of_a_run_with_preemption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(request_trace, "tracer", provider.get_tracer("test"))

    prompts = {f"r{i}": [i + 1] * (9 + 3 * i) for i in range(6)}
    params = SamplingParams(max_tokens=24, temperature=0.0)
    scheduler = make_scheduler(num_blocks=24, block_size=4, budget=64, chunk=8)
    worker = FakeWorker(4)
    traces: dict[str, RequestTrace] = {}
    for request_id, prompt in prompts.items():
        scheduler.add_request(request_id, prompt, params)
        traces[request_id] = RequestTrace(None, request_id, len(prompt), "tenant")
    chunk_tokens: dict[str, int] = {}
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        plan_pb = plan_to_pb(plan)
        trace_plan(plan, plan_pb, scheduler.requests, traces.get)
        for chunk in plan_pb.prefill_traces:
            assert chunk.traceparent == traces[chunk.request_id].traceparent
            chunk_tokens[chunk.request_id] = chunk_tokens.get(chunk.request_id, 0)
            chunk_tokens[chunk.request_id] += chunk.chunk_tokens
        for output in scheduler.update(plan, worker.execute(plan)):
            trace = traces[output.request_id]
            if output.new_token_ids and trace.first_token_at is None:
                trace.first_token(time.monotonic())
            if output.finish_reason is not None:
                trace.ended(
                    "completed", finish_reason_label(output.finish_reason), params.max_tokens
                )
    assert scheduler.num_preemptions > 0

    spans = exporter.get_finished_spans()
    for name in ("scheduler.request", "queue", "decode"):
        assert sum(1 for s in spans if s.name == name) == len(prompts), name
    requests = [s for s in spans if s.name == "scheduler.request"]
    preempted = sum(1 for s in requests for e in s.events if e.name == "preempted")
    assert preempted == scheduler.num_preemptions
    for span in requests:
        request_id = str(span.attributes["kvmesh.request_id"])
        recomputed = sum(1 for e in span.events if e.name == "preempted")
        # Every prompt token is prefilled once, plus whatever a preemption made it recompute.
        assert chunk_tokens[request_id] >= len(prompts[request_id])
        if not recomputed:
            assert chunk_tokens[request_id] == len(prompts[request_id])
        assert span.attributes["gen_ai.usage.output_tokens"] == params.max_tokens
    for span in spans:
        if span.name != "scheduler.request":
            assert span.parent is not None  # queue and decode hang under their request

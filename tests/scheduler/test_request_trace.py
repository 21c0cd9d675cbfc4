"""A request's scheduler spans over a real scheduling run with preemption: one request span,
one queue span, one decode span each; preemptions as events; every prompt token's prefill
chunk sent to the worker for its span. Planned ahead, a request's queue lasts until its step
begins on the worker."""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler import request_trace
from services.scheduler.request_trace import RequestTrace, StepTally, trace_plan
from services.scheduler.step_pipeline import StepPipeline
from shared.codec import plan_from_pb, plan_to_pb, result_to_pb
from shared.outputs import finish_reason_label
from shared.pb.kvmesh.v1 import engine_worker_pb2
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
    tally = StepTally()
    for request_id, prompt in prompts.items():
        scheduler.add_request(request_id, prompt, params)
        traces[request_id] = RequestTrace(None, request_id, len(prompt), "tenant", tally)
    chunk_tokens: dict[str, int] = {}
    batches: list[int] = []  # each step's
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        plan_pb = plan_to_pb(plan)
        trace_plan(plan, plan_pb, scheduler.requests, traces.get, tally)()  # lock-step: begins now
        batches.append(len(plan.new_requests) + len(plan.running_requests))
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
    assert tally.steps == len(batches) and tally.batch_total == sum(batches)
    recomputes = {  # a request span's id -> its preemptions (each recomputation samples one)
        span.context.span_id: sum(1 for e in span.events if e.name == "preempted")
        for span in requests
    }
    for span in (s for s in spans if s.name == "decode"):
        # The steps run while it decoded: at least one a token after its first (less those a
        # recomputation sampled), and no more than were run; their mean batch within the run's.
        steps = int(span.attributes["kvmesh.decode.steps"])
        assert span.parent is not None
        assert params.max_tokens - 1 - recomputes[span.parent.span_id] <= steps <= len(batches)
        assert 1 <= float(span.attributes["kvmesh.batch_size.mean"]) <= max(batches)


class WorkerInOrder:
    """The WorkerLink's two calls: plans run one after another, in the order sent."""

    def __init__(self, worker: FakeWorker, log: list[tuple[str, int]]) -> None:
        self.worker, self.log = worker, log
        self.sent: collections.deque[engine_worker_pb2.StepPlan] = collections.deque()

    async def send(self, plan_pb: engine_worker_pb2.StepPlan) -> None:
        self.sent.append(plan_pb)

    async def receive(self) -> engine_worker_pb2.StepResult:
        plan_pb = self.sent.popleft()
        self.log.append(("result", plan_pb.step_id))
        return result_to_pb(self.worker.execute(plan_from_pb(plan_pb)))


async def test_a_step_planned_ahead_starts_when_the_step_before_it_comes_back() -> None:
    scheduler = make_scheduler(budget=8, chunk=8)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    traces = {}
    tally = StepTally()
    for index in range(3):  # one prompt of 8 a step: each waits behind the one before
        scheduler.add_request(f"r{index}", [index + 1] * 8, params)
        traces[f"r{index}"] = RequestTrace(None, f"r{index}", 8, "tenant", tally)
    log: list[tuple[str, int]] = []
    link = WorkerInOrder(FakeWorker(4), log)
    pipeline = StepPipeline(link, scheduler, True, lambda *_: None)  # type: ignore[arg-type]

    def starts(started: Callable[[], None], step_id: int) -> None:
        log.append(("start", step_id))
        started()

    while scheduler.has_unfinished() or pipeline.sent:
        plan = scheduler.schedule()
        if plan.num_scheduled_tokens == 0:
            await pipeline.settle_oldest()
            continue
        first = trace_plan(plan, plan_to_pb(plan), scheduler.requests, traces.get, tally)
        await pipeline.send(plan, plan_to_pb(plan), functools.partial(starts, first, plan.step_id))
        await pipeline.after_send()

    starts_at = {step: index for index, (kind, step) in enumerate(log) if kind == "start"}
    results_at = {step: index for index, (kind, step) in enumerate(log) if kind == "result"}
    assert len(starts_at) == len(results_at) >= 3
    for step, index in starts_at.items():
        if step - 1 in results_at:  # planned while the step before was in flight
            assert results_at[step - 1] < index, log
    assert all(trace.scheduled_at is not None for trace in traces.values())

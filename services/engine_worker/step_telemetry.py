"""A step's telemetry: its metrics, a span per traced prefill chunk and per KV tier load."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from services.engine_worker.kv_tiers.transfer import LoadRecord
from shared.pb.kvmesh.v1 import engine_worker_pb2
from shared.runtime.metrics import TOKEN_SECONDS
from shared.runtime.telemetry import context_from_traceparent

tracer = trace.get_tracer("kvmesh.engine_worker")
STEP_SECONDS = Histogram(
    "kvmesh_step_duration_seconds", "One forward pass and sampling", buckets=TOKEN_SECONDS
)
BATCH_SIZE = Histogram(
    "kvmesh_step_batch_size", "Requests in one step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
TOKENS_COMPUTED = Counter(
    "kvmesh_tokens_computed",
    "Tokens through the model: prefill (prompts, chunks, recomputation) or decode",
    ["phase"],
)


def record_step(
    plan: engine_worker_pb2.StepPlan,
    seconds: float,
    started_ns: int,
    worker: str,
    loads: Sequence[LoadRecord] = (),
) -> None:
    """Step metrics, and one span per traced prefill chunk (the step's whole compute time:
    the chunk shares the forward pass with the rest of the batch)."""
    running = list(plan.running.num_scheduled_tokens)
    batch_size = len(plan.new_requests) + len(running)
    prefill = sum(r.num_scheduled_tokens for r in plan.new_requests)
    decode = running.count(1)
    prefill += sum(running) - decode
    tokens = prefill + decode
    STEP_SECONDS.observe(seconds)
    BATCH_SIZE.observe(batch_size)
    TOKENS_COMPUTED.labels("prefill").inc(prefill)
    TOKENS_COMPUTED.labels("decode").inc(decode)
    ended_ns = started_ns + round(seconds * 1e9)
    for chunk in plan.prefill_traces:
        span = tracer.start_span(
            "prefill",
            context=context_from_traceparent(chunk.traceparent),
            start_time=started_ns,
            attributes={
                "kvmesh.request_id": chunk.request_id,
                "kvmesh.chunk_tokens": chunk.chunk_tokens,
                "kvmesh.prefix_hit_tokens": chunk.cached_tokens,
                "kvmesh.start_position": chunk.start_position,
                "kvmesh.batch_size": batch_size,
                "kvmesh.batch_tokens": tokens,
                "kvmesh.step_id": plan.step_id,
                "kvmesh.worker": worker,
            },
        )
        span.end(end_time=ended_ns)
    traced = {chunk.request_id: chunk.traceparent for chunk in plan.prefill_traces}
    for load in loads:  # a KV tier load: its own span, before the step's prefill
        if load.request_id not in traced:
            continue
        span = tracer.start_span(
            "kv_load",
            context=context_from_traceparent(traced[load.request_id]),
            start_time=load.started_ns,
            attributes={
                "kvmesh.request_id": load.request_id,
                "kvmesh.loaded_tokens": load.loaded_tokens,
                "kvmesh.kv_load.outcome": load.outcome,
                "kvmesh.worker": worker,
            },
        )
        span.end(end_time=load.started_ns + round(load.seconds * 1e9))

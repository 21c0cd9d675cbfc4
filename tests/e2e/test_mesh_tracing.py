"""Telemetry through the real mesh: one trace per request across the four request-path
services, phases that nest and add up to what the client measured, collector percentiles that
match the client's own, Prometheus endpoints, and a collector that dies without failing work."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import inference_pb2, inference_pb2_grpc, traces_pb2, traces_pb2_grpc
from tests.e2e.mesh_helpers import (
    assert_one_terminal,
    collect,
    ids_request,
    text_request,
    tiny_mesh_config,
)

SERVICES = {"gateway", "tokenizer", "scheduler", "engine-worker"}
# Spans and the parent each must hang under.
PARENT_OF = {
    "admission": "kvmesh.Generate",
    "tokenize": "kvmesh.Generate",
    "tokenizer.Encode": "tokenize",
    "rate_limit": "kvmesh.Generate",
    "route": "kvmesh.Generate",
    "scheduler.request": "kvmesh.Generate",
    "queue": "scheduler.request",
    "prefill": "scheduler.request",
    "decode": "scheduler.request",
    "detokenize": "kvmesh.Generate",
    "tokenizer.Detokenize": "detokenize",
    "delivery": "kvmesh.Generate",
}
SECRET = "zebra-umbrella-7391"  # in every prompt; must never reach a span
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
NS_SLACK = 2_000_000  # 2 ms: spans from different processes, one wall clock
# The queue ends as the scheduler hands the step on; the worker's first chunk begins when the
# step arrives: one loopback hop apart (3.6 ms seen on a loaded 2-vCPU Xeon VM).
HOP_NS = 25_000_000


@dataclass
class ClientTiming:
    request_id: str
    e2e_ms: float = 0.0
    ttft_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    trace_id: str = ""


async def timed_generate(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...] = (),
) -> ClientTiming:
    timing = ClientTiming(request.request_id)
    started = time.monotonic()
    last: float | None = None
    async for event in stub.Generate(request, metadata=metadata, timeout=120):
        now = time.monotonic()
        kind = event.WhichOneof("event")
        if kind == "accepted":
            timing.trace_id = event.accepted.trace_id
        elif kind == "delta" and event.delta.token_ids:
            if last is None:
                timing.ttft_ms = (now - started) * 1e3
            else:
                timing.gaps_ms.append((now - last) * 1e3)
            last = now
        elif kind == "completed":
            timing.completion_tokens = event.completed.usage.completion_tokens
    timing.e2e_ms = (time.monotonic() - started) * 1e3
    return timing


async def wait_for_trace(
    traces: traces_pb2_grpc.TracesStub, request_id: str, services: set[str] = SERVICES
) -> traces_pb2.Trace:
    """Spans arrive in batches from four processes: poll until every service has sent its."""
    deadline = time.monotonic() + 10
    while True:
        try:
            trace = await traces.GetTrace(traces_pb2.GetTraceRequest(request_id=request_id))
            names = {span.name for span in trace.spans}
            if services <= {span.service for span in trace.spans} and set(PARENT_OF) <= names:
                return trace
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
        assert time.monotonic() < deadline, f"trace of {request_id} incomplete"
        await asyncio.sleep(0.1)


def duration_ms(span: traces_pb2.SpanRecord) -> float:
    return (span.end_unix_ns - span.start_unix_ns) / 1e6


def assert_trace_is_whole(trace: traces_pb2.Trace, client: ClientTiming) -> None:
    by_id = {span.span_id: span for span in trace.spans}
    by_name: dict[str, list[traces_pb2.SpanRecord]] = {}
    for span in trace.spans:
        by_name.setdefault(span.name, []).append(span)
    assert {span.service for span in trace.spans} == SERVICES
    assert set(PARENT_OF) <= set(by_name), sorted(by_name)
    (root,) = by_name["kvmesh.Generate"]
    for span in trace.spans:
        if span is root:
            continue
        parent = by_id[span.parent_span_id]  # every span links to one in the same trace
        if span.name in PARENT_OF:
            assert parent.name == PARENT_OF[span.name], (span.name, parent.name)
        assert parent.start_unix_ns - NS_SLACK <= span.start_unix_ns, span.name
        assert span.end_unix_ns <= parent.end_unix_ns + NS_SLACK, span.name

    # The root is what the client waited for, less the loopback hops.
    root_ms = duration_ms(root)
    assert root_ms <= client.e2e_ms + 2, (root_ms, client.e2e_ms)
    assert root_ms >= client.e2e_ms * 0.9 - 10, (root_ms, client.e2e_ms)
    # The gateway's phases, one after another, account for the root.
    sequence = ["admission", "tokenize", "rate_limit", "route", "scheduler.request"]
    gateway_ms = sum(duration_ms(by_name[name][0]) for name in sequence)
    assert 0.9 * root_ms - 5 <= gateway_ms <= root_ms + 1, (gateway_ms, root_ms)
    # And the scheduler's phases follow one another through its request span: the queue from
    # arrival until its first step is handed to the worker (never ending more than the hop
    # before that step begins: time no span covers), the prefill chunks, then decode from the
    # first token to the end.
    (request,) = by_name["scheduler.request"]
    (queue,) = by_name["queue"]
    (decode,) = by_name["decode"]
    chunks = sorted(by_name["prefill"], key=lambda span: span.start_unix_ns)
    assert abs(queue.start_unix_ns - request.start_unix_ns) <= NS_SLACK
    assert chunks[0].start_unix_ns - HOP_NS <= queue.end_unix_ns <= chunks[0].end_unix_ns
    assert chunks[-1].end_unix_ns - NS_SLACK <= decode.start_unix_ns
    assert abs(decode.end_unix_ns - request.end_unix_ns) <= NS_SLACK

    attributes = dict(root.attributes)
    assert attributes["gen_ai.request.model"]
    assert int(attributes["gen_ai.usage.input_tokens"]) > 0
    assert int(attributes["gen_ai.usage.output_tokens"]) == client.completion_tokens
    assert attributes["gen_ai.response.finish_reasons"] == "length"
    for chunk in by_name["prefill"]:
        assert int(chunk.attributes["kvmesh.chunk_tokens"]) > 0
        assert int(chunk.attributes["kvmesh.batch_size"]) >= 1
        assert "kvmesh.prefix_hit_tokens" in chunk.attributes
    for span in trace.spans:
        for value in span.attributes.values():
            assert SECRET not in value, f"prompt text in span {span.name}"


async def test_one_trace_per_request_across_the_mesh(mesh: Mesh) -> None:
    async with (
        grpc.aio.insecure_channel(mesh.gateway_address) as channel,
        grpc.aio.insecure_channel(mesh.collector_address) as collector,
    ):
        inference = inference_pb2_grpc.InferenceStub(channel)
        traces = traces_pb2_grpc.TracesStub(collector)
        requests = []
        for index in range(4):
            request = text_request(
                f"{SECRET} Tell me fact number {index} about the sea.",
                max_tokens=12,
                ignore_eos=True,
            )
            request.request_id = f"trace-{index}-{time.monotonic_ns()}"
            requests.append(request)
        client_parent = (("traceparent", f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"),)
        timings = await asyncio.gather(
            timed_generate(inference, requests[0], client_parent),
            *(timed_generate(inference, r) for r in requests[1:]),
        )
        assert timings[0].trace_id == CLIENT_TRACE_ID  # the client's traceparent is honoured
        assert len({t.trace_id for t in timings}) == 4  # one trace per request
        for client in timings:
            trace = await wait_for_trace(traces, client.request_id)
            assert trace.trace_id == client.trace_id
            assert_trace_is_whole(trace, client)
        first = await wait_for_trace(traces, timings[0].request_id)
        root = next(s for s in first.spans if s.name == "kvmesh.Generate")
        assert root.parent_span_id == CLIENT_SPAN_ID


async def test_collector_percentiles_match_the_clients_timings(mesh: Mesh) -> None:
    async with (
        grpc.aio.insecure_channel(mesh.gateway_address) as channel,
        grpc.aio.insecure_channel(mesh.collector_address) as collector,
    ):
        inference = inference_pb2_grpc.InferenceStub(channel)
        traces = traces_pb2_grpc.TracesStub(collector)
        started = time.time()
        timings: list[ClientTiming] = []
        for wave in range(3):  # 12 requests, 4 at a time, prompts of different lengths
            batch = []
            for index in range(4):
                request = text_request(
                    "Count with me: " + "one two " * (4 * index + wave),
                    max_tokens=8 + 4 * index,
                    ignore_eos=True,
                )
                request.request_id = f"pct-{wave}-{index}-{time.monotonic_ns()}"
                batch.append(timed_generate(inference, request))
            timings += await asyncio.gather(*batch)
        for client in timings:
            await wait_for_trace(traces, client.request_id)
        stats = await traces.GetPhaseStats(
            traces_pb2.PhaseStatsRequest(window_s=time.time() - started + 0.5)
        )
    assert stats.requests == len(timings)
    phases = {p.phase: p for p in stats.phases}
    client_samples = {
        "ttft": [t.ttft_ms for t in timings],
        "e2e": [t.e2e_ms for t in timings],
        "itl": [g for t in timings for g in t.gaps_ms],
    }
    for phase, samples in client_samples.items():
        assert phases[phase].count == len(samples), phase
        for q, collected in ((50, phases[phase].p50_ms), (95, phases[phase].p95_ms)):
            mine = float(np.percentile(samples, q))
            assert abs(collected - mine) <= 0.1 * mine + 10, (phase, q, collected, mine)
    for phase in ("queue", "tokenize", "prefill", "decode", "tpot"):
        assert phases[phase].count == len(timings), phase


def scrape(url: str, openmetrics: bool = False) -> str:
    request = urllib.request.Request(url)
    if openmetrics:
        request.add_header("Accept", "application/openmetrics-text; version=1.0.0")
    with urllib.request.urlopen(request, timeout=5) as reply:
        return str(reply.read().decode())


def metric_value(text: str, name: str) -> float:
    """A sample's value in the text format; `name` may carry its labels."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[-1])
    raise AssertionError(f"{name} not exposed")


async def test_every_service_serves_prometheus_metrics(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        events = await collect(inference, text_request("Say hi.", max_tokens=4))
        assert assert_one_terminal(events) == "completed"
    texts = {s.name: scrape(s.metrics_url) for s in mesh.services if s.metrics_url}
    assert set(texts) >= {"gateway", "tokenizer", "scheduler-0", "engine-worker-0"}
    gateway, scheduler = texts["gateway"], texts["scheduler-0"]
    for name in (
        "kvmesh_time_to_first_token_seconds_count",
        "kvmesh_time_per_output_token_seconds_count",
        "kvmesh_inter_token_latency_seconds_count",
        "kvmesh_e2e_request_latency_seconds_count",
        "kvmesh_admitted_total",
    ):
        assert metric_value(gateway, name) >= 1, name
    assert 'kvmesh_requests_total{outcome="completed",reason="length"}' in gateway
    assert metric_value(scheduler, "kvmesh_queue_time_seconds_count") >= 1
    assert metric_value(scheduler, "kvmesh_kv_blocks_free") > 0
    for name in (
        "kvmesh_requests_running",
        "kvmesh_requests_waiting",
        "kvmesh_kv_blocks_used",
        "kvmesh_prefix_cache_hit_tokens_total",
        "kvmesh_preemptions_total",
        "kvmesh_cancellations_total",
        "kvmesh_cancel_to_freed_seconds_count",
    ):
        assert name in scheduler or name.replace("_total", "") in scheduler, name
    assert metric_value(texts["engine-worker-0"], "kvmesh_step_duration_seconds_count") >= 1
    for name, text in texts.items():
        if name != "trace-collector":
            assert metric_value(text, 'kvmesh_spans_dropped_total{cause="queue_full"}') == 0
    # Exemplars (OpenMetrics only) lead from a latency bucket to a trace.
    assert 'trace_id="' in scrape(mesh.service("gateway").metrics_url or "", openmetrics=True)


@pytest.fixture(scope="module")
def tiny_mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log_dir = str(tmp_path_factory.mktemp("tracing-tiny-mesh-logs"))
    with Mesh(tiny_mesh_config(tiny_llama_dir, log_dir)) as running:
        yield running


async def test_stopping_the_collector_mid_load_fails_no_request(tiny_mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(tiny_mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)

        async def one(index: int) -> str:
            await asyncio.sleep(0.02 * index)
            request = ids_request([1, 2, 3, index + 4], max_tokens=24, ignore_eos=True)
            return assert_one_terminal(await collect(inference, request))

        load = asyncio.gather(*(one(i) for i in range(40)))
        await asyncio.sleep(0.3)
        tiny_mesh.service("trace-collector").process.kill()
        outcomes = await load
        assert outcomes == ["completed"] * 40
        after = await collect(inference, ids_request([5, 6], max_tokens=4, ignore_eos=True))
        assert assert_one_terminal(after) == "completed"
    # The spans that could not be sent are counted, not waited for.
    deadline = time.monotonic() + 10
    url = tiny_mesh.service("gateway").metrics_url or ""
    dropped = 'kvmesh_spans_dropped_total{cause="export_failed"}'
    while metric_value(scrape(url), dropped) == 0:
        assert time.monotonic() < deadline, "dropped spans not counted"
        await asyncio.sleep(0.2)


async def test_kvmesh_trace_draws_the_waterfall_and_the_summary(mesh: Mesh, tmp_path: Path) -> None:
    async with (
        grpc.aio.insecure_channel(mesh.gateway_address) as channel,
        grpc.aio.insecure_channel(mesh.collector_address) as collector,
    ):
        request = text_request("Name a colour.", max_tokens=6, ignore_eos=True)
        request.request_id = f"cli-{time.monotonic_ns()}"
        await timed_generate(inference_pb2_grpc.InferenceStub(channel), request)
        await wait_for_trace(traces_pb2_grpc.TracesStub(collector), request.request_id)

    def kvmesh_trace(*args: str) -> subprocess.CompletedProcess[str]:
        command = [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "trace",
            "--collector",
            mesh.collector_address,
        ]
        return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)

    svg = tmp_path / "waterfall.svg"
    drawn = kvmesh_trace(request.request_id, "--svg", str(svg))
    assert drawn.returncode == 0, drawn.stderr
    *lines, wrote = drawn.stdout.splitlines()
    assert wrote == f"wrote {svg}"
    assert lines[0].startswith(f"request {request.request_id}")
    for name in ("kvmesh.Generate", "tokenize", "queue", "prefill", "decode", "delivery"):
        assert any(line.split()[0] == name and "█" in line for line in lines[1:-1]), name
    assert "ttft" in lines[-1] and "6 tokens" in lines[-1]
    assert svg.read_text().startswith("<svg") and svg.read_text().count("<rect") == len(lines) - 2
    summary = kvmesh_trace("--summary")
    assert summary.returncode == 0
    assert {row.split()[0] for row in summary.stdout.splitlines()[2:]} == {
        "queue",
        "tokenize",
        "prefill",
        "decode",
        "ttft",
        "tpot",
        "itl",
        "e2e",
    }
    missing = kvmesh_trace("no-such-request")
    assert missing.returncode == 2 and "TRACE_NOT_FOUND" in missing.stderr


async def test_a_cancelled_request_is_traced_as_cancelled(mesh: Mesh) -> None:
    async with (
        grpc.aio.insecure_channel(mesh.gateway_address) as channel,
        grpc.aio.insecure_channel(mesh.collector_address) as collector,
    ):
        request = text_request("Write a long story.", max_tokens=400, ignore_eos=True)
        request.request_id = f"cancel-{time.monotonic_ns()}"
        call = inference_pb2_grpc.InferenceStub(channel).Generate(request)
        async for event in call:
            if event.WhichOneof("event") == "delta" and event.delta.token_ids:
                break
        call.cancel()
        trace = await wait_for_trace(traces_pb2_grpc.TracesStub(collector), request.request_id)
    by_name = {span.name: span for span in trace.spans}
    root, scheduled = by_name["kvmesh.Generate"], by_name["scheduler.request"]
    assert root.attributes["kvmesh.outcome"] == "cancelled"
    assert root.attributes["gen_ai.response.finish_reasons"] == "client_disconnected"
    assert scheduled.attributes["kvmesh.outcome"] == "cancelled"
    causes = [e.name for e in scheduled.events]
    assert "cancelled" in causes
    assert trace.timing.outcome == "cancelled"


async def test_an_http_request_is_traced_like_a_grpc_one(mesh: Mesh) -> None:
    """The OpenAI front shares the gRPC path: the same spans, the client's traceparent."""
    trace_id, request_id = "5ce0e9a56015fec5aadfa328ae398115", f"http-{time.monotonic_ns()}"
    async with openai.AsyncOpenAI(base_url=mesh.http_url, api_key="-", max_retries=0) as client:
        answer = await client.completions.create(
            model="",
            prompt="The sea is",
            max_tokens=6,
            extra_body={"ignore_eos": True},
            extra_headers={
                "traceparent": f"00-{trace_id}-{CLIENT_SPAN_ID}-01",
                "X-Request-Id": request_id,
            },
        )
    assert answer.id == f"cmpl-{request_id}"
    async with grpc.aio.insecure_channel(mesh.collector_address) as collector:
        trace = await wait_for_trace(traces_pb2_grpc.TracesStub(collector), request_id)
    assert trace.trace_id == trace_id
    root = next(s for s in trace.spans if s.name == "kvmesh.Generate")
    assert root.parent_span_id == CLIENT_SPAN_ID
    assert dict(root.attributes)["gen_ai.usage.output_tokens"] == "6"

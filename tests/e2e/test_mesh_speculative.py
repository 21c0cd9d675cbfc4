"""Speculative decoding on the mesh: a scheduler run with --speculative ngram gives the same
greedy answer as the in-process engine without drafts, reports its draft counts in the
completed event's timings, in its trace and as Prometheus counters, and a request can opt out.
The same scheduler runs with --stream-interval 4: tokens reach the client four or more at a time,
the first alone and at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.engine import Engine
from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.config import CacheConfig, EngineConfig
from shared.pb.kvmesh.v1 import inference_pb2_grpc, traces_pb2, traces_pb2_grpc
from shared.sampling import SamplingParams
from tests.e2e.conftest import MESH_WORKER_ARGS
from tests.e2e.mesh_helpers import collect, ids_request, metric_value

COPY = "Copy this list exactly:\nred\ngreen\nblue\nred\ngreen\nblue\nred\ngreen\nblue\nred\n"


@pytest.fixture(scope="module")
def speculative_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        worker_threads=2,
        worker_args=MESH_WORKER_ARGS,
        scheduler_args=[
            *("--speculative", "ngram", "--num-speculative-tokens", "6"),
            *("--stream-interval", "4"),
        ],
        log_dir=str(tmp_path_factory.mktemp("speculative-mesh-logs")),
        drain_seconds=5,
    )
    with Mesh(config) as running:
        yield running


async def test_drafts_on_the_mesh_keep_the_greedy_answer_and_are_counted(
    speculative_mesh: Mesh,
) -> None:
    engine = Engine(EngineConfig(cache=CacheConfig(kv_memory_bytes=64 << 20)))
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": COPY}])
    expected = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    async with grpc.aio.insecure_channel(speculative_mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = ids_request(prompt, max_tokens=40, temperature=0.0)
        request.request_id = "speculating-1"
        events = await collect(stub, request)
        opted_out = await collect(
            stub,
            ids_request(prompt, max_tokens=40, temperature=0.0, disable_speculation=True),
        )
    tokens = [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]
    assert tokens == expected.token_ids
    timings = events[-1].completed.timings
    assert timings.draft_tokens >= timings.accepted_draft_tokens > 0
    assert opted_out[-1].completed.timings.draft_tokens == 0
    # No drafts: one token a step, sent four at a time after the first; all of them, in order.
    deltas = [e.delta for e in opted_out if e.WhichOneof("event") == "delta"]
    sizes = [len(delta.token_ids) for delta in deltas if delta.token_ids]
    assert sizes[0] == 1 and all(size == 4 for size in sizes[1:-1]) and sizes[-1] <= 4
    opted_tokens = [t for delta in deltas for t in delta.token_ids]
    assert opted_tokens == expected.token_ids
    scheduler = next(s for s in speculative_mesh.services if s.name.startswith("scheduler"))
    assert scheduler.metrics_url is not None
    accepted = metric_value(scheduler.metrics_url, "kvmesh_spec_accepted_draft_tokens_total")
    assert accepted >= timings.accepted_draft_tokens
    async with grpc.aio.insecure_channel(speculative_mesh.collector_address) as collector:
        span = await span_with(traces_pb2_grpc.TracesStub(collector), "speculating-1")
    assert span.attributes["kvmesh.spec.draft_tokens"] == str(timings.draft_tokens)
    assert span.attributes["kvmesh.spec.accepted_tokens"] == str(timings.accepted_draft_tokens)


async def span_with(traces: traces_pb2_grpc.TracesStub, request_id: str) -> traces_pb2.SpanRecord:
    """The request's span that carries its draft counts (spans arrive in batches)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            trace = await traces.GetTrace(traces_pb2.GetTraceRequest(request_id=request_id))
            for span in trace.spans:
                if "kvmesh.spec.draft_tokens" in span.attributes:
                    return span
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
        assert time.monotonic() < deadline, f"no span of {request_id} has draft counts"
        await asyncio.sleep(0.1)

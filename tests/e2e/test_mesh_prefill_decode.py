"""The prefill/decode split through the whole mesh: a long prompt prefilled on the prefill pair,
its blocks pulled worker to worker, decoded on the decode pair; the same tokens as a mixed
mesh; a short one skips the prefill pair; leases end, blocks come back, and the pull's failure
policies give what they say."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import (
    common_pb2,
    engine_worker_pb2,
    engine_worker_pb2_grpc,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    traces_pb2,
    traces_pb2_grpc,
)
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    assert_one_terminal,
    collect,
    ids_request,
    metric_value,
    rich_error,
)

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(170)]  # 10 full blocks of 16, and 10 tokens
SHORT = [(5 * i + 1) % 250 + 1 for i in range(40)]


def split_mesh(model_dir: str, log_dir: str, *scheduler_args: str) -> MeshConfig:
    return MeshConfig(
        model=model_dir,
        prefill_workers=1,
        decode_workers=1,
        worker_threads=1,
        worker_args=["--kv-memory", "16MiB"],
        scheduler_args=list(scheduler_args),
        gateway_args=["--handover-min-tokens", "64"],
        log_dir=log_dir,
        drain_seconds=2,
    )


def answer(events) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    return [
        (lp.token_id, lp.logprob) for e in events if e.HasField("delta") for lp in e.delta.logprobs
    ]


async def generate(address: str, prompt: list[int], max_tokens: int = 12):  # type: ignore[no-untyped-def]
    request = ids_request(
        prompt, max_tokens=max_tokens, ignore_eos=True, logprobs=1, temperature=0.0
    )
    async with grpc.aio.insecure_channel(address) as channel:
        events = await collect(inference_pb2_grpc.InferenceStub(channel), request)
    assert assert_one_terminal(events) == "completed", events[-1]
    return events


@pytest.fixture(scope="module")
def mixed_answers(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    config = MeshConfig(
        model=tiny_llama_dir,
        worker_threads=1,
        worker_args=["--kv-memory", "16MiB"],
        log_dir=str(tmp_path_factory.mktemp("mixed-logs")),
        drain_seconds=2,
    )
    with Mesh(config) as mesh:

        async def both() -> dict:
            return {
                "long": answer(await generate(mesh.gateway_address, PROMPT)),
                "short": answer(await generate(mesh.gateway_address, SHORT)),
            }

        return asyncio.run(both())


@pytest.fixture(scope="module")
def recomputing(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A split mesh with the default policies."""
    with Mesh(split_mesh(tiny_llama_dir, str(tmp_path_factory.mktemp("split")))) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def failing(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A split mesh whose decode pair fails a short handover, and whose leases are short."""
    args = ("--kv-load-failure", "fail", "--handover-lease-s", "1")
    with Mesh(split_mesh(tiny_llama_dir, str(tmp_path_factory.mktemp("fail")), *args)) as mesh:
        yield mesh


async def test_a_long_prompt_is_prefilled_on_one_pair_and_decoded_on_the_other(
    recomputing: Mesh, mixed_answers: dict
) -> None:
    mesh = recomputing
    prefill, decode = mesh.scheduler_addresses
    prefill_worker, decode_worker = mesh.worker_addresses
    split = await generate(mesh.gateway_address, PROMPT)
    short = await generate(mesh.gateway_address, SHORT)
    await assert_mesh_idle(mesh)  # every lease ended, every block back
    received = metric_value(
        mesh.service("engine-worker-1").metrics_url or "",
        'kvmesh_kv_handover_bytes_total{direction="received"}',
    )
    # Token for token what a mixed mesh gives. The logprobs agree to float rounding, not bit
    # for bit: the decode pair computes the prompt's tail and the first token in one prefill
    # pass, where a mixed pair decodes that token.
    for got, want in ((split, mixed_answers["long"]), (short, mixed_answers["short"])):
        assert [token for token, _ in answer(got)] == [token for token, _ in want]
        assert [lp for _, lp in answer(got)] == pytest.approx([lp for _, lp in want], abs=1e-4)
    assert len(answer(split)) == 12
    execution = split[-1].completed.execution
    assert execution.scheduler == decode and execution.worker == decode_worker
    handover = execution.handover
    assert handover.prefill_scheduler == prefill and handover.prefill_worker == prefill_worker
    assert (handover.blocks, handover.outcome) == (len(PROMPT) // 16, "ok")
    assert handover.bytes > 0 and received >= handover.bytes
    assert [a.scheduler for a in execution.attempts] == [prefill, decode]
    assert split[-1].completed.timings.loaded_tokens == 16 * (len(PROMPT) // 16)
    assert split[-1].completed.usage.completion_tokens == 12
    # Under the threshold: straight to the decode pair, no handover.
    assert short[-1].completed.execution.scheduler == decode
    assert not short[-1].completed.execution.HasField("handover")
    # One trace: prefill on one worker, the handover, the rest on the other.
    spans = await trace_spans(mesh.collector_address, split[0].accepted.request_id)
    (pull,) = [span for span in spans if span.name == "kv_handover"]
    assert pull.attributes["kvmesh.handover.prefill_worker"] == prefill_worker
    assert pull.attributes["kvmesh.handover.outcome"] == "ok"
    assert {s.attributes["kvmesh.worker"] for s in spans if s.name == "prefill"} == {
        prefill_worker,
        decode_worker,  # the decode pair's first step: the prompt's tail and the first token
    }
    assert sum(span.name == "scheduler.request" for span in spans) == 2


async def trace_spans(collector: str, request_id: str) -> list[traces_pb2.SpanRecord]:
    """The request's spans, once both pairs' schedulers and workers have sent theirs."""
    deadline = time.monotonic() + 10
    async with grpc.aio.insecure_channel(collector) as channel:
        traces = traces_pb2_grpc.TracesStub(channel)
        while True:
            try:
                trace = await traces.GetTrace(traces_pb2.GetTraceRequest(request_id=request_id))
                names = [span.name for span in trace.spans]
                both = names.count("prefill") >= 2 and names.count("scheduler.request") >= 2
                if "kv_handover" in names and both:
                    return list(trace.spans)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.NOT_FOUND
            assert time.monotonic() < deadline, f"trace of {request_id} incomplete"
            await asyncio.sleep(0.1)


def submit(address: str, request: scheduler_pb2.SubmitRequest) -> grpc.aio.UnaryStreamCall:
    channel = grpc.aio.insecure_channel(address)
    return scheduler_pb2_grpc.SchedulerStub(channel).Submit(request, timeout=60)


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def prefilled(prefill: str, request_id: str) -> tuple[grpc.aio.UnaryStreamCall, list]:
    """A prefill-only request on the prefill pair, read up to its handover ticket."""
    call = submit(
        prefill,
        scheduler_pb2.SubmitRequest(
            request_id=request_id, token_ids=PROMPT, sampling=greedy(1), prefill_only=True
        ),
    )
    events = [await call.read() for _ in range(3)]
    assert [e.WhichOneof("event") for e in events] == ["accepted", "tokens", "finished"]
    assert events[-1].finished.handover.num_blocks == len(PROMPT) // 16
    return call, events


async def test_an_unclaimed_lease_expires_and_frees_the_prefill_blocks(failing: Mesh) -> None:
    mesh = failing
    prefill, _ = mesh.scheduler_addresses
    call, events = await prefilled(prefill, "leased-1")
    ticket = events[-1].finished.handover
    started = time.monotonic()
    assert await call.read() is grpc.aio.EOF  # the scheduler ends the stream itself
    assert 0.5 < time.monotonic() - started < 10
    async with grpc.aio.insecure_channel(ticket.worker) as channel:
        export = engine_worker_pb2_grpc.EngineWorkerStub(channel).ExportBlocks(
            engine_worker_pb2.ExportRequest(lease_id=ticket.lease_id, num_blocks=1)
        )
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            async for _ in export:
                pass
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    scheduler_metrics = mesh.service("scheduler-0").metrics_url or ""
    assert metric_value(scheduler_metrics, "kvmesh_kv_handover_leases_expired_total") == 1
    await assert_mesh_idle(mesh)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_a_handover_whose_blocks_never_arrive_follows_the_policy(
    recomputing: Mesh, failing: Mesh, policy: str, mixed_answers: dict
) -> None:
    mesh = recomputing if policy == "recompute" else failing
    decode = mesh.scheduler_addresses[1]
    first = [*PROMPT, mixed_answers["long"][0][0]]
    # A ticket naming a lease the prefill worker never held: nothing arrives.
    lost = scheduler_pb2.HandoverTicket(
        worker=mesh.worker_addresses[0], lease_id="never-leased", num_blocks=10
    )
    call = submit(
        decode,
        scheduler_pb2.SubmitRequest(
            request_id=f"handed-{policy}",
            token_ids=first,
            sampling=greedy(11),
            handover=lost,
            cache_salt=b"policy",  # none of the mesh's cached blocks: all of it recomputed
        ),
    )
    if policy == "fail":
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call.read()
        error = rich_error(failed.value)
        assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "KV_HANDOVER_FAILED")
    else:
        accepted = (await call.read()).accepted
        assert (accepted.handover_blocks, accepted.handover_outcome) == (0, "lease_not_found")
        tokens: list[int] = []
        while (event := await call.read()).WhichOneof("event") == "tokens":
            tokens += event.tokens.token_ids
        assert event.WhichOneof("event") == "finished"
        assert event.finished.loaded_tokens == 0  # all of it recomputed
        assert tokens == [token for token, _ in mixed_answers["long"][1:]]
    await assert_mesh_idle(mesh)


async def test_a_handed_over_http_stream_parks_on_its_decode_pair(recomputing: Mesh) -> None:
    """Past its handover, a plain HTTP stream is relayed by the gateway's step pass
    (parked_relays.py), with the text its gRPC twin streams from its task."""
    mesh = recomputing
    prompt = [(11 * i + 5) % 250 + 1 for i in range(170)]  # no other test's: not cached
    gateway_metrics = mesh.gateways[0].metrics_url or ""
    worker_metrics = mesh.service("engine-worker-1").metrics_url or ""
    pulled = 'kvmesh_kv_handover_bytes_total{direction="received"}'
    before = [
        metric_value(gateway_metrics, "kvmesh_gateway_step_pass_deltas_total"),
        metric_value(worker_metrics, pulled),
    ]
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0.0}
    body |= {"stream": True, "ignore_eos": True}
    chunks = await asyncio.to_thread(sse_chunks, mesh.http_url, body)
    after = [
        metric_value(gateway_metrics, "kvmesh_gateway_step_pass_deltas_total"),
        metric_value(worker_metrics, pulled),
    ]
    assert after[0] > before[0] and after[1] > before[1]  # handed over, then parked
    request = ids_request(prompt, max_tokens=40, ignore_eos=True, temperature=0.0)
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        events = await collect(inference_pb2_grpc.InferenceStub(channel), request)
    want = "".join(e.delta.text for e in events if e.HasField("delta"))
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == want
    await assert_mesh_idle(mesh)


def sse_chunks(base_url: str, body: dict) -> list[dict]:
    url = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    models = json.loads(urllib.request.urlopen(f"{base_url}/models", timeout=10).read())
    connection.request(
        "POST", "/v1/completions", json.dumps(body | {"model": models["data"][0]["id"]})
    )
    lines = connection.getresponse().read().split(b"\n\n")
    connection.close()
    return [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]

"""Two gateways sharing the public gRPC and HTTP ports (`kvmesh up --gateways 2`), on the sim
backend: connections spread over both, and each case the mesh suite holds for one gateway
holds for the pair: streams, n > 1, cancel and deadlines (nothing left held), a tenant's rate
limit and its request ids across both, an Abort through either, one trace a request, and a
gateway killed outright restarted by the supervisor while the other serves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import grpc
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import inference_pb2, inference_pb2_grpc, traces_pb2, traces_pb2_grpc
from shared.runtime.restarts import BackOff
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    assert_one_terminal,
    keys_file,
    metric_value,
    output_ids,
    read_rest,
    rich_error,
    text_request,
    wait_health,
)

KEYS = """
[tenants.acme]
keys = ["sk-acme"]
admin = true

[tenants.limited]
keys = ["sk-limited"]
requests_per_second = 0.2
"""
ACME = (("authorization", "Bearer sk-acme"),)
LIMITED = (("authorization", "Bearer sk-limited"),)
CONNECTIONS = 16  # all on one gateway by chance: 2^-15


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = keys_file(tmp_path_factory, KEYS)
    config = MeshConfig(
        worker_args=["--backend", "sim", "--sim-step-ms", "2", "--kv-memory", "64MiB"],
        gateways=2,
        tokenizers=2,
        gateway_args=["--api-keys-file", keys],
        log_dir=str(tmp_path_factory.mktemp("gateways-logs")),
        drain_seconds=2,
        supervise=True,
        back_off=BackOff(first_s=0.2, max_s=1.0, steady_s=5.0),
    )
    with Mesh(config) as running:
        yield running


def admitted(mesh: Mesh) -> dict[str, float]:
    """Each gateway's kvmesh_admitted_total, from its own metrics port."""
    token = mesh.secrets.mesh_token  # auth is on: the scrape token
    return {
        g.name: metric_value(g.metrics_url or "", "kvmesh_admitted_total", token)
        for g in mesh.gateways
    }


async def generate(
    address: str, request: inference_pb2.GenerateRequest, metadata=ACME, timeout: float = 30
) -> list[inference_pb2.GenerateEvent]:
    """On a connection of its own (channels share one unless told not to): the kernel picks
    its gateway."""
    own = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=own) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return [e async for e in stub.Generate(request, metadata=metadata, timeout=timeout)]


async def sse_tokens(mesh: Mesh, session: aiohttp.ClientSession) -> tuple[int, bool]:
    """A streamed completion's token count (from its usage) and whether [DONE] ended it."""
    body = {
        "prompt": "Count to ten.",
        "max_tokens": 9,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": "Bearer sk-acme"}
    async with session.post(f"{mesh.http_url}/completions", json=body, headers=headers) as reply:
        assert reply.status == 200
        lines = [line.strip() async for line in reply.content if line.strip()]
    usage = json.loads(lines[-2][6:])["usage"]
    return usage["completion_tokens"], lines[-1] == b"data: [DONE]"


def test_every_gateway_has_a_port_of_its_own_beside_the_shared_one(mesh: Mesh) -> None:
    own = [g.address for g in mesh.gateways]
    assert [g.name for g in mesh.gateways] == ["gateway-0", "gateway-1"]
    assert len(set(own)) == 2 and mesh.gateway_address not in own
    assert {s.name for s in mesh.services} >= {"tokenizer-0", "tokenizer-1"}


async def test_connections_spread_over_both_gateways_and_every_stream_completes(
    mesh: Mesh,
) -> None:
    before = admitted(mesh)
    request = text_request("Why is the sky blue?", max_tokens=12, ignore_eos=True, seed=3)
    runs = await asyncio.gather(
        *(generate(mesh.gateway_address, request) for _ in range(CONNECTIONS))
    )
    assert {assert_one_terminal(events) for events in runs} == {"completed"}
    assert {tuple(output_ids(events)) for events in runs} != {()}
    assert len({tuple(output_ids(events)) for events in runs}) == 1  # seeded: one answer
    connector = aiohttp.TCPConnector(force_close=True)  # a connection a stream
    async with aiohttp.ClientSession(connector=connector) as session:
        streamed = await asyncio.gather(*(sse_tokens(mesh, session) for _ in range(CONNECTIONS)))
    assert set(streamed) == {(9, True)}
    after = admitted(mesh)
    served = {name: after[name] - before[name] for name in after}
    assert sum(served.values()) == 2 * CONNECTIONS
    assert all(count > 0 for count in served.values()), served


async def test_n_cancel_and_deadline_leave_nothing_held(mesh: Mesh) -> None:
    parallel = text_request("Name a colour.", max_tokens=6, ignore_eos=True, seed=1)
    parallel.n = 2
    events = await generate(mesh.gateway_address, parallel)
    assert sorted({e.index for e in events if e.HasField("completed")}) == [0, 1]
    long = text_request("Tell me a long story.", max_tokens=2000, ignore_eos=True)
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(long, metadata=ACME)
        while not (await call.read()).HasField("delta"):
            pass
        call.cancel()
    long.timeout_ms = 400  # the mesh's own deadline: 2,000 steps of 2 ms take 4 s
    late = await generate(mesh.gateway_address, long)
    assert assert_one_terminal(late) == "failed"
    assert late[-1].failed.error.reason == "DEADLINE_EXCEEDED"
    await assert_mesh_idle(mesh)


async def test_a_tenants_rate_limit_holds_across_both_gateways(mesh: Mesh) -> None:
    first, second = (g.grpc_address for g in mesh.gateways)
    request = text_request("hi", max_tokens=2, ignore_eos=True)
    assert assert_one_terminal(await generate(first, request, LIMITED)) == "completed"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(second, request, LIMITED)  # the other gateway: the same Redis bucket
    error = rich_error(refused.value)
    assert (error.reason, error.retryable) == ("RATE_LIMITED", True)


async def test_an_abort_reaches_the_stream_through_either_gateway_and_its_id_is_held_by_both(
    mesh: Mesh,
) -> None:
    first, second = (g.grpc_address for g in mesh.gateways)
    long = text_request("Tell me a long story.", max_tokens=2000, ignore_eos=True)
    long.request_id = f"gateways-abort-{time.monotonic_ns()}"
    abort = inference_pb2.AbortRequest(request_id=long.request_id)
    async with grpc.aio.insecure_channel(first) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(long, metadata=ACME)
        while not (await call.read()).HasField("delta"):
            pass
        with pytest.raises(grpc.aio.AioRpcError) as reused:
            await generate(second, long)  # open on the first gateway: claimed for the tenant
        assert rich_error(reused.value).reason == "INVALID_ARGUMENT"
        # Refused by the second gateway's claim in Redis, not left to the scheduler
        assert reused.value.details() == f"request id {long.request_id!r} is in use"
        async with grpc.aio.insecure_channel(second) as other:
            stub = inference_pb2_grpc.InferenceStub(other)
            assert not (await stub.Abort(abort, metadata=LIMITED)).found  # not that tenant's
            assert (await stub.Abort(abort, metadata=ACME)).found  # asked of its peer
        rest = await read_rest(call)
    assert rest[-1].cancelled.reason == "abort"
    long.sampling.max_tokens = 2
    deadline = time.monotonic() + 5
    while True:  # the id is free again once the first gateway's cleanup ran
        try:
            assert assert_one_terminal(await generate(second, long)) == "completed"
            break
        except grpc.aio.AioRpcError:
            assert time.monotonic() < deadline, "the id stayed claimed"
            await asyncio.sleep(0.05)
    await assert_mesh_idle(mesh)


async def test_each_request_is_one_trace(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.collector_address) as channel:
        traces = traces_pb2_grpc.TracesStub(channel)
        for index in range(4):
            request = text_request("Say hello.", max_tokens=3, ignore_eos=True)
            request.request_id = f"gateways-trace-{index}-{time.monotonic_ns()}"
            events = await generate(mesh.gateway_address, request)
            trace_id = events[0].accepted.trace_id
            deadline = time.monotonic() + 10
            while True:
                try:
                    trace = await traces.GetTrace(
                        traces_pb2.GetTraceRequest(request_id=request.request_id), metadata=ACME
                    )
                    roots = [s for s in trace.spans if s.name == "kvmesh.Generate"]
                    if roots and {"scheduler", "tokenizer"} <= {s.service for s in trace.spans}:
                        break
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.NOT_FOUND
                assert time.monotonic() < deadline, f"no whole trace of {request.request_id}"
                await asyncio.sleep(0.1)
            assert trace.trace_id == trace_id and len(roots) == 1


async def test_a_draining_gateway_takes_no_new_connection_and_ends_its_streams(
    mesh: Mesh,
) -> None:
    draining = mesh.gateways[0]
    held = text_request("A long story.", max_tokens=1000, ignore_eos=True)  # 2 s of steps
    async with grpc.aio.insecure_channel(draining.grpc_address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(held, metadata=ACME)
        assert (await call.read()).HasField("accepted")
        pid = draining.process.pid
        os.kill(pid, signal.SIGTERM)  # drains (2 s), exits; the supervisor starts it again
        while not draining.has_logged("draining"):
            await asyncio.sleep(0.02)
        request = text_request("Meanwhile?", max_tokens=3, ignore_eos=True)
        runs = await asyncio.gather(*(generate(mesh.gateway_address, request) for _ in range(8)))
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            streamed = await asyncio.gather(*(sse_tokens(mesh, session) for _ in range(8)))
        rest = await read_rest(call)
    assert {assert_one_terminal(events) for events in runs} == {"completed"}
    assert set(streamed) == {(9, True)}  # none refused by the draining gateway
    assert rest[-1].WhichOneof("event") in ("completed", "failed")  # its stream ended once
    deadline = time.monotonic() + 30
    while draining.process.pid == pid or draining.process.poll() is not None:
        assert time.monotonic() < deadline, "the drained gateway was not started again"
        await asyncio.sleep(0.05)
    await wait_health(draining.grpc_address, serving=True)


async def test_a_killed_gateway_is_restarted_while_the_other_serves(mesh: Mesh) -> None:
    killed = mesh.gateways[1]
    pid = killed.process.pid
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}") and killed.process.pid == pid:
        await asyncio.sleep(0.01)  # reaped: its listening sockets are closed
    request = text_request("Still there?", max_tokens=4, ignore_eos=True)
    for _ in range(6):  # new connections go to the gateway that is left
        assert assert_one_terminal(await generate(mesh.gateway_address, request)) == "completed"
    deadline = time.monotonic() + 30
    while killed.process.pid == pid or killed.process.poll() is not None:
        assert time.monotonic() < deadline, "the killed gateway was not restarted"
        await asyncio.sleep(0.05)
    await wait_health(killed.grpc_address, serving=True)
    events = await generate(killed.grpc_address, request)
    assert assert_one_terminal(events) == "completed"
    await assert_mesh_idle(mesh)

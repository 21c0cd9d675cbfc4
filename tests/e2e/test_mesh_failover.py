"""Failures inside the engine and of a whole worker, on a live mesh of two pairs (tiny model):

- a request that raises in a step ends alone with `failed` EXECUTION_FAILED, not retryable,
  and however many do, the worker's circuit breaker does not count them: its other requests
  sample; a worker whose every request fails turns not ready (the breaker) and traffic moves;
- a worker lost before the first token: the gateway places each of its requests once more on
  the other pair, and every one completes there with two attempts in its execution record.

Two gateways share the mesh's ports (`--gateways 2`), as `kvmesh up` runs on a larger host.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    assert_one_terminal,
    collect,
    ids_request,
    output_ids,
    read_rest,
    rich_error,
    tiny_mesh_config,
    wait_health,
)

POISON = 511  # the tiny model's last token id: a prompt holding it fails after one token
BREAKS_WORKER = 510  # a prompt holding it breaks its worker: every request fails from then on
BREAKER_FAILURES = 3
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


@pytest.fixture(scope="module")
def pair_mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("failover-logs")))
    config.workers = 2
    config.gateways = 2  # sharing the ports: each places and fails over on its own
    config.worker_args = [
        *config.worker_args,
        "--inject-fault-token",
        f"{POISON}:1,{BREAKS_WORKER}:1:worker",
        "--breaker-failures",
        str(BREAKER_FAILURES),
        "--breaker-cooldown-seconds",
        "600",  # stays tripped for the rest of the test
    ]
    config.gateway_args = ["--tenant-failures-per-minute", "0"]  # the breaker's test, not that
    with Mesh(config) as running:
        yield running


@pytest.fixture
async def inference(pair_mesh: Mesh):
    async with grpc.aio.insecure_channel(pair_mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def collect_call(call: grpc.aio.UnaryStreamCall) -> list[inference_pb2.GenerateEvent]:
    return [event async for event in call]


async def ready_replicas(inference) -> int:
    reply = await inference.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
    return sum(v.ready_replicas for v in reply.versions)


async def until_ready_replicas(mesh: Mesh, count: int, timeout: float = 60) -> None:
    """Until every gateway, each at its own port, sees `count` ready replicas."""
    deadline = time.monotonic() + timeout
    for gateway in mesh.gateways:
        async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
            inference = inference_pb2_grpc.InferenceStub(channel)
            while await ready_replicas(inference) != count:
                assert time.monotonic() < deadline, f"{gateway.name} never saw {count} ready"
                await asyncio.sleep(0.05)


async def test_a_worker_lost_before_the_first_token_fails_over_to_the_other_pair(
    pair_mesh: Mesh, inference
) -> None:
    scheduler_0, scheduler_1 = pair_mesh.scheduler_addresses
    prompts = [[7, 8, index, 9] for index in range(16)]
    # Only pair 0 takes requests, and its worker computes none of them yet.
    pair_mesh.service("scheduler-1").process.terminate()
    await until_ready_replicas(pair_mesh, 1)
    worker_0 = pair_mesh.service("engine-worker-0").process
    os.kill(worker_0.pid, signal.SIGSTOP)
    calls = [
        inference.Generate(ids_request(p, max_tokens=12, temperature=0.0, ignore_eos=True))
        for p in prompts
    ]
    for call in calls:
        accepted = await call.read()
        assert accepted.accepted.routing.scheduler == scheduler_0
    pair_mesh.restart("scheduler-1")
    await until_ready_replicas(pair_mesh, 2)
    worker_0.kill()

    streams = await asyncio.gather(*(read_rest(call) for call in calls))
    for events in streams:  # each read after its `accepted`
        assert [e.WhichOneof("event") for e in events][-2:] == ["usage", "completed"], events[-1]
        execution = events[-1].completed.execution
        assert execution.scheduler == scheduler_1
        first, second = execution.attempts
        assert (first.scheduler, first.error_reason) == (scheduler_0, "WORKER_LOST")
        assert (second.scheduler, second.error_reason) == (scheduler_1, "")
        assert first.attempt_id.endswith("#1") and second.attempt_id.endswith("#2")
        assert first.attempt_id[:-2] == second.attempt_id[:-2]
    # The moved requests produced what the same requests produce on a healthy pair.
    fresh = await collect(
        inference, ids_request(prompts[5], max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert output_ids(fresh) == output_ids([e for e in streams[5] if e.HasField("delta")])
    assert len(fresh[-1].completed.execution.attempts) == 1
    pair_mesh.restart("engine-worker-0")
    await until_ready_replicas(pair_mesh, 2)
    await assert_mesh_idle(pair_mesh)


async def test_a_failing_request_ends_alone_and_a_failing_worker_turns_not_ready(
    pair_mesh: Mesh, inference
) -> None:
    healthy = [
        inference.Generate(ids_request([3, 4, i], max_tokens=40, ignore_eos=True)) for i in range(3)
    ]
    # Twice the breaker's count of failing requests, over two pairs: none of them trips it.
    for attempt in range(2 * BREAKER_FAILURES):
        events = await collect(inference, ids_request([POISON, 5, attempt], max_tokens=20))
        assert [e.WhichOneof("event") for e in events[:2]] == ["accepted", "delta"]
        error = events[-1].failed.error
        assert (error.reason, error.retryable, error.grpc_code) == (
            "EXECUTION_FAILED",
            False,
            INTERNAL,
        )
        assert "Injected" not in error.message  # the exception's class stays in the log
        assert len(events[-1].failed.error.message) > 0
    for call in healthy:  # requests beside the failing ones were not disturbed
        assert assert_one_terminal(await collect_call(call)) == "completed"
    assert await ready_replicas(inference) == 2
    # A broken worker: everything it computes fails, and its breaker trips.
    events = await collect(inference, ids_request([BREAKS_WORKER, 5], max_tokens=20))
    assert events[-1].failed.error.reason == "EXECUTION_FAILED"
    tripped = events[0].accepted.routing.scheduler
    failed_there = 1
    while await ready_replicas(inference) == 2:
        try:
            events = await collect(inference, ids_request([6, failed_there], max_tokens=4))
        except grpc.aio.AioRpcError as error:  # tripped, before the gateway saw it
            assert rich_error(error).reason in ("MODEL_NOT_READY", "WORKER_UNAVAILABLE")
            break
        if events[0].accepted.routing.scheduler == tripped:
            assert events[-1].failed.error.reason == "EXECUTION_FAILED"
            failed_there += 1
        assert failed_there <= BREAKER_FAILURES + 1, "the broken worker's breaker never tripped"
    await until_ready_replicas(pair_mesh, 1)
    index = pair_mesh.scheduler_addresses.index(tripped)
    other = pair_mesh.scheduler_addresses[1 - index]
    await wait_health(tripped, serving=False)
    routed = await asyncio.gather(
        *(collect(inference, ids_request([6, i], max_tokens=8)) for i in range(6))
    )
    assert {events[0].accepted.routing.scheduler for events in routed} == {other}
    pair_mesh.restart(f"engine-worker-{index}")
    await wait_health(tripped, serving=True)
    await until_ready_replicas(pair_mesh, 2)
    await assert_mesh_idle(pair_mesh)

"""A worker that dies mid-stream, on a mesh of a tiny random model (no tokenizer: token ids)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.launcher import Mesh
from shared.pb.kvmesh.v1 import inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.mesh_helpers import (
    assert_one_terminal,
    collect,
    ids_request,
    read_rest,
    rich_error,
    tiny_mesh_config,
)


@pytest.fixture(scope="module")
def tiny_mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("tiny-mesh-logs")))
    with Mesh(config) as running:
        yield running


async def wait_not_serving(address: str, timeout: float = 10) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout
        while True:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return
            assert time.monotonic() < deadline, f"{address} still serving"
            await asyncio.sleep(0.05)


async def test_a_lost_worker_fails_streams_and_readiness_drops(tiny_mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(tiny_mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        ok = await collect(inference, ids_request([1, 2, 3], max_tokens=4, ignore_eos=True))
        assert assert_one_terminal(ok) == "completed"
        call = inference.Generate(ids_request([1, 2, 3], max_tokens=1000, ignore_eos=True))
        assert (await call.read()).WhichOneof("event") == "accepted"
        running = await call.read()
        assert running.WhichOneof("event") == "delta", [str(e) for e in await read_rest(call)]
        tiny_mesh.service("engine-worker-0").process.kill()
        rest = await read_rest(call)
        assert rest[-1].WhichOneof("event") == "failed"
        error = rest[-1].failed.error
        assert error.reason == "WORKER_LOST" and error.retryable and error.retry_after_ms > 0

        await wait_not_serving(tiny_mesh.scheduler_addresses[0])
        await wait_not_serving(tiny_mesh.gateway_address)
        async with grpc.aio.insecure_channel(tiny_mesh.scheduler_addresses[0]) as sched:
            load = await scheduler_pb2_grpc.SchedulerStub(sched).GetLoad(
                scheduler_pb2.LoadRequest()
            )
        assert not load.worker_ready and load.num_running == 0

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(inference, ids_request([1, 2, 3], max_tokens=4))
        refusal = rich_error(refused.value)
        assert (refusal.code, refusal.reason) == (grpc.StatusCode.UNAVAILABLE, "MODEL_NOT_READY")
        assert refusal.retryable and refusal.retry_delay_ms

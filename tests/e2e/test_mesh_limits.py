"""Admission limits, deadlines that cannot be met, and a draining gateway, on a mesh that
runs one request at a time and queues at most one more."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import MESH_WORKER_ARGS
from tests.e2e.mesh_helpers import (
    assert_one_terminal,
    collect,
    read_rest,
    rich_error,
    settled_load,
    text_request,
    wait_health,
)


@pytest.fixture(scope="module")
def narrow_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        worker_threads=2,
        worker_args=MESH_WORKER_ARGS,
        scheduler_args=["--max-num-seqs", "1", "--max-waiting", "1"],
        # The scheduler's own limits are under test: the gateway's queue-time watermark would
        # refuse first (one long request ahead is a queue of many seconds).
        gateway_args=["--max-queue-ms", "0"],
        log_dir=str(tmp_path_factory.mktemp("narrow-mesh-logs")),
        drain_seconds=20,
    )
    with Mesh(config) as running:
        yield running


@pytest.fixture
async def inference(narrow_mesh: Mesh):
    async with grpc.aio.insecure_channel(narrow_mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def start_running(inference, max_tokens: int = 400) -> grpc.aio.UnaryStreamCall:
    """A long request that holds the only running slot once its first delta arrives."""
    call = inference.Generate(
        text_request("An endless story:", max_tokens=max_tokens, ignore_eos=True)
    )
    assert (await call.read()).WhichOneof("event") == "accepted"
    assert (await call.read()).WhichOneof("event") == "delta"
    return call


async def test_a_full_queue_refuses_with_overloaded_and_retry_advice(
    narrow_mesh: Mesh, inference
) -> None:
    running = await start_running(inference)
    queued = inference.Generate(text_request("Queued:", max_tokens=4))
    assert (await queued.read()).accepted.queue_position == 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(inference, text_request("One too many:", max_tokens=4))
    error = rich_error(refused.value)
    assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
    assert error.retryable and error.retry_delay_ms and error.retry_delay_ms > 0
    running.cancel()
    rest = await read_rest(queued)  # the queued request runs once the slot frees
    assert rest[-1].WhichOneof("event") == "completed"
    await settled_load(narrow_mesh.scheduler_addresses[0])


async def test_a_request_that_cannot_start_before_its_deadline_is_never_prefilled(
    narrow_mesh: Mesh, inference
) -> None:
    scheduler = scheduler_pb2_grpc.SchedulerStub(
        grpc.aio.insecure_channel(narrow_mesh.scheduler_addresses[0])
    )
    before = await scheduler.GetLoad(scheduler_pb2.LoadRequest())
    running = await start_running(inference)
    events = await collect(inference, text_request("Too late:", max_tokens=4), timeout=2.0)
    assert assert_one_terminal(events) == "failed"
    error = events[-1].failed.error
    assert error.reason == "DEADLINE_EXCEEDED" and error.retryable
    assert events[-2].usage.completion_tokens == 0
    after = await scheduler.GetLoad(scheduler_pb2.LoadRequest())
    assert after.num_expired_waiting == before.num_expired_waiting + 1
    assert after.num_expired_running == before.num_expired_running
    # A deadline too short to start at all is refused before it is queued.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        short = text_request("No time:", max_tokens=4)
        short.timeout_ms = 10
        await collect(inference, short)
    assert rich_error(refused.value).reason == "DEADLINE_EXCEEDED"
    running.cancel()
    await settled_load(narrow_mesh.scheduler_addresses[0])


async def test_sigterm_drains_in_flight_streams_then_exits(narrow_mesh: Mesh, inference) -> None:
    """Runs last: it stops this module's gateway."""
    gateway = narrow_mesh.service("gateway")
    # Few tokens: they must finish within the drain grace (20 s) even on a machine kept busy.
    streaming = await start_running(inference, max_tokens=8)
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.address is not None
    await wait_health(gateway.address, serving=False)  # the drain began (however busy we are)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(inference, text_request("After SIGTERM:", max_tokens=4))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = await read_rest(streaming)
    assert rest[-1].WhichOneof("event") == "completed"
    assert rest[-1].completed.usage.completion_tokens == 8
    assert await asyncio.to_thread(gateway.process.wait, 30) == 0

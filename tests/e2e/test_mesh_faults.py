"""Services killed and restarted on a live mesh of two worker + scheduler pairs (a tiny random
model, token ids in and out). What each failure does to in-flight and to new requests:

- engine-worker: in-flight `failed` WORKER_LOST (UNAVAILABLE), retryable only if no
  token was emitted; new ones go to the other pair; the restarted worker is reattached.
- scheduler: in-flight `failed` WORKER_LOST, same retry rule; new ones go to the other pair.
- tokenizer: in-flight `failed` TOKENIZER_LOST, same retry rule; new ones refused with
  TOKENIZER_LOST (retryable) until it is back.
- trace-collector: requests unaffected (spans are dropped and counted).
- redis-server: requests unaffected, routing and limits local until it is back
  (test_mesh_redis.py).

SIGTERM instead drains: readiness off, nothing new taken, every accepted request finishes, then
the process exits. A draining worker's scheduler stops taking requests, finishes its own, and
lets go of the worker. A client that stops reading is cancelled after the stall timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    assert_one_terminal,
    collect,
    health_status,
    ids_request,
    read_rest,
    rich_error,
    tiny_mesh_config,
    wait_health,
)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@pytest.fixture(scope="module")
def pair_mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("fault-mesh-logs")))
    config.workers = 2
    config.drain_seconds = 30  # in-flight requests finish well within it
    config.gateway_args = ["--stall-timeout-s", "1"]
    with Mesh(config) as running:
        yield running


@pytest.fixture(autouse=True)
def restart_the_dead(pair_mesh: Mesh) -> Iterator[None]:
    """A test that failed half-way leaves no dead service behind for the next one."""
    yield
    for service in list(pair_mesh.services):
        if service.process.poll() is not None:
            pair_mesh.restart(service.name)


@pytest.fixture
async def inference(pair_mesh: Mesh):
    async with grpc.aio.insecure_channel(pair_mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def start_long(inference, prompt: list[int]) -> tuple[grpc.aio.UnaryStreamCall, str]:
    """A request that streams for a long while; returns it (first delta read) and its scheduler."""
    call = inference.Generate(ids_request(prompt, max_tokens=1500, ignore_eos=True))
    accepted = await call.read()
    assert accepted.WhichOneof("event") == "accepted"
    assert (await call.read()).WhichOneof("event") == "delta"
    return call, accepted.accepted.routing.scheduler


async def failed_error(call: grpc.aio.UnaryStreamCall) -> common_pb2.Error:
    """The error of the `failed` event that must end this stream."""
    rest = await read_rest(call)
    assert rest[-1].WhichOneof("event") == "failed", rest[-1]
    return rest[-1].failed.error


def submit_directly(scheduler: str, request_id: str) -> grpc.aio.UnaryStreamCall:
    channel = grpc.aio.insecure_channel(scheduler)
    return scheduler_pb2_grpc.SchedulerStub(channel).Submit(
        scheduler_pb2.SubmitRequest(
            request_id=request_id,
            token_ids=[5, 6, 7],
            sampling=ids_request([], max_tokens=4, ignore_eos=True).sampling,
        ),
        timeout=60,
    )


async def routed_to(inference, count: int) -> set[str]:
    """Where `count` concurrent short requests went; each must complete."""

    async def one(index: int) -> str:
        events = await collect(
            inference, ids_request([9, index, 3], max_tokens=24, ignore_eos=True)
        )
        assert assert_one_terminal(events) == "completed"
        return events[0].accepted.routing.scheduler

    return set(await asyncio.gather(*(one(i) for i in range(count))))


async def until_routed_to(inference, scheduler: str, timeout: float = 30) -> None:
    """Rounds of concurrent requests until one of them lands on `scheduler` (the gateway sees
    a restarted one once its channel reconnects, within the reconnect backoff)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while scheduler not in seen:
        assert time.monotonic() < deadline, f"nothing routed to {scheduler}: {seen}"
        seen |= await routed_to(inference, 6)
        await asyncio.sleep(0.1)


async def test_a_killed_worker_fails_its_streams_and_a_restart_restores_it(
    pair_mesh: Mesh, inference
) -> None:
    running, home = await start_long(inference, [1, 2, 3])
    index = pair_mesh.scheduler_addresses.index(home)
    other = pair_mesh.scheduler_addresses[1 - index]
    worker = pair_mesh.service(f"engine-worker-{index}").process
    # Frozen first, so a second request is accepted and queued there without any token.
    os.kill(worker.pid, signal.SIGSTOP)
    queued = submit_directly(home, "queued-on-a-dying-worker")
    assert (await queued.read()).WhichOneof("event") == "accepted"
    worker.kill()

    error = await failed_error(running)
    assert (error.reason, error.grpc_code) == ("WORKER_LOST", UNAVAILABLE)
    assert not error.retryable  # tokens went out: a blind resend would repeat them
    queued_end = (await read_rest(queued))[-1]
    assert queued_end.failed.reason == "WORKER_LOST" and queued_end.failed.retryable

    await wait_health(home, serving=False)
    async with grpc.aio.insecure_channel(home) as channel:
        load = await scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(scheduler_pb2.LoadRequest())
    assert not load.worker_ready and load.num_open_streams == 0
    assert await health_status(pair_mesh.gateway_address) == health_pb2.HealthCheckResponse.SERVING
    assert await routed_to(inference, 4) == {other}

    pair_mesh.restart(f"engine-worker-{index}")  # nothing else is restarted
    await wait_health(home, serving=True)
    direct = [e async for e in submit_directly(home, "after-the-restart")]
    assert direct[-1].WhichOneof("event") == "finished"
    await until_routed_to(inference, home)  # the gateway sends requests there again
    await assert_mesh_idle(pair_mesh)


async def test_a_killed_scheduler_fails_its_streams_and_others_take_new_ones(
    pair_mesh: Mesh, inference
) -> None:
    running, home = await start_long(inference, [4, 5, 6])
    index = pair_mesh.scheduler_addresses.index(home)
    other = pair_mesh.scheduler_addresses[1 - index]
    pair_mesh.service(f"scheduler-{index}").process.kill()
    error = await failed_error(running)
    assert (error.reason, error.grpc_code, error.retryable) == ("WORKER_LOST", UNAVAILABLE, False)

    deadline = time.monotonic() + 10
    while True:  # every request goes to the other pair once the gateway noticed
        try:
            if await routed_to(inference, 4) == {other}:
                break
        except grpc.aio.AioRpcError as refused:  # sent there just before it noticed
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() < deadline
    pair_mesh.restart(f"scheduler-{index}")  # reattaches to its worker, which forgot the old one
    await until_routed_to(inference, home)
    await assert_mesh_idle(pair_mesh)


async def test_a_killed_tokenizer_fails_streams_and_refuses_until_restarted(
    pair_mesh: Mesh, inference
) -> None:
    running, _ = await start_long(inference, [7, 8, 9])
    pair_mesh.service("tokenizer").process.kill()
    error = await failed_error(running)
    assert (error.reason, error.grpc_code, error.retryable) == (
        "TOKENIZER_LOST",
        UNAVAILABLE,
        False,
    )

    deadline = time.monotonic() + 10
    while True:  # refused up front once the gateway's health watch noticed
        try:
            events = await collect(inference, ids_request([1, 2], max_tokens=2))
        except grpc.aio.AioRpcError as refused:
            error_seen = rich_error(refused)
            assert (error_seen.code, error_seen.reason) == (
                grpc.StatusCode.UNAVAILABLE,
                "TOKENIZER_LOST",
            )
            assert error_seen.retryable and error_seen.retry_delay_ms
            break
        assert events[-1].failed.error.reason == "TOKENIZER_LOST"  # accepted just before
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)

    pair_mesh.restart("tokenizer")
    await wait_health(pair_mesh.gateway_address, serving=True)
    events = await collect(inference, ids_request([1, 2], max_tokens=4, ignore_eos=True))
    assert assert_one_terminal(events) == "completed"
    await assert_mesh_idle(pair_mesh)


async def test_a_killed_trace_collector_does_not_touch_requests(pair_mesh: Mesh, inference) -> None:
    async def load(count: int) -> list[str]:
        async def one(index: int) -> str:
            request = ids_request([index, 2, 3], max_tokens=16, ignore_eos=True)
            return assert_one_terminal(await collect(inference, request))

        return await asyncio.gather(*(one(i) for i in range(count)))

    background = asyncio.create_task(load(12))
    pair_mesh.service("trace-collector").process.kill()
    assert set(await background) == {"completed"}
    assert set(await load(6)) == {"completed"}
    pair_mesh.restart("trace-collector")
    assert set(await load(6)) == {"completed"}
    await assert_mesh_idle(pair_mesh)


async def short_streams(inference, count: int, max_tokens: int = 300) -> list[asyncio.Task]:
    """`count` requests streaming at once, each past its first delta."""

    async def one(index: int) -> list[inference_pb2.GenerateEvent]:
        call = inference.Generate(
            ids_request([index, 7, 7], max_tokens=max_tokens, ignore_eos=True)
        )
        first = [await call.read(), await call.read()]
        started.release()
        return first + await read_rest(call)

    started = asyncio.Semaphore(0)
    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    for _ in range(count):  # bounded: a refused request never releases
        await asyncio.wait_for(started.acquire(), 30)
    return tasks


@pytest.mark.parametrize("service", ["engine-worker", "scheduler", "tokenizer"])
async def test_sigterm_drains_every_accepted_request(
    pair_mesh: Mesh, inference, service: str
) -> None:
    streams = await short_streams(inference, 6)
    name = "tokenizer" if service == "tokenizer" else f"{service}-0"
    process = pair_mesh.service(name).process
    process.send_signal(signal.SIGTERM)
    for stream in streams:  # not one accepted request dropped
        events = await stream
        assert assert_one_terminal(events) == "completed", events[-1]
        assert events[-1].completed.usage.completion_tokens == 300
    exited = await asyncio.to_thread(process.wait, 30)
    assert exited == 0
    if service != "tokenizer":  # the other pair serves meanwhile
        assert await routed_to(inference, 4) == {pair_mesh.scheduler_addresses[1]}
    pair_mesh.restart(name)
    await wait_health(pair_mesh.scheduler_addresses[0], serving=True)
    await wait_health(pair_mesh.gateway_address, serving=True)
    assert assert_one_terminal(await collect(inference, ids_request([2, 2], max_tokens=3))) == (
        "completed"
    )
    await assert_mesh_idle(pair_mesh)


async def test_a_client_that_stops_reading_is_cancelled_and_its_blocks_freed(
    pair_mesh: Mesh,
) -> None:
    # A 1 KiB stream window and no BDP probing to grow it: the gateway's writes block after a
    # few events (~5 here). With the default 64 KiB window ~450 of the 1,500 events fit before
    # they did, and one CI run saw the whole answer delivered instead of the stall.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    async with grpc.aio.insecure_channel(pair_mesh.gateway_address, options=options) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = ids_request([4, 4, 4], max_tokens=1500, ignore_eos=True, logprobs=20)
        call = stub.Generate(request)
        accepted = await call.read()
        home = accepted.accepted.routing.scheduler
        # Reading nothing: once the output fills the window, flow control blocks the gateway's
        # writes and the 1 s stall timeout cancels. How soon the window fills depends on how
        # fast this machine decodes, so poll rather than sleep a fixed time.
        deadline = time.monotonic() + 20
        async with grpc.aio.insecure_channel(home) as sched:
            while True:
                await asyncio.sleep(0.5)
                load = await scheduler_pb2_grpc.SchedulerStub(sched).GetLoad(
                    scheduler_pb2.LoadRequest()
                )
                if load.num_open_streams == 0 or time.monotonic() > deadline:
                    break
        assert load.num_open_streams == 0 and load.num_blocks_referenced == 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await read_rest(call)  # what was buffered, then the status
        error = rich_error(ended.value)
        assert (error.code, error.reason, error.retryable) == (
            grpc.StatusCode.CANCELLED,
            "CLIENT_STALLED",
            False,
        )
    await assert_mesh_idle(pair_mesh)

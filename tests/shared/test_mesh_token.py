"""The mesh token on an internal port: a real ServiceRuntime server with one set refuses a call
without it (unary and streaming alike) with UNAUTHENTICATED, takes one from the mesh's own
channels (asyncio and blocking), and leaves health and the services that check callers
themselves open; a public server never asks for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.mesh.service_process import free_port
from shared.pb.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.runtime import mesh_token
from shared.runtime.service import ServiceRuntime
from shared.runtime.tls import aio_channel, sync_channel
from tests.e2e.mesh_helpers import rich_error


class Echo(scheduler_pb2_grpc.SchedulerServicer):
    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        return scheduler_pb2.SchedulerAbortResponse(found=request.request_id == "r1")

    async def SubmitLanes(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for message in request_iterator:
            reply = scheduler_pb2.SubmitLanesResponse()
            for lane in message.lanes:
                reply.token_lanes.append(lane.lane)
                reply.token_ids.append(7)
            yield reply


async def serving(public: bool = False, open_services: tuple[str, ...] = ()) -> ServiceRuntime:
    runtime = ServiceRuntime("kvmesh.v1.Scheduler", "127.0.0.1", free_port(), public, open_services)
    runtime.add_servicer(scheduler_pb2_grpc.add_SchedulerServicer_to_server, Echo())
    await runtime.start()
    return runtime


async def lanes_reply(stub: scheduler_pb2_grpc.SchedulerStub) -> list[int]:
    async def requests() -> AsyncIterator[scheduler_pb2.SubmitLanesRequest]:
        yield scheduler_pb2.SubmitLanesRequest(lanes=[scheduler_pb2.SubmitLane(lane=3)])

    async for reply in stub.SubmitLanes(requests(), timeout=10):
        return list(reply.token_lanes)
    return []


async def test_an_internal_port_wants_the_mesh_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mesh_token.ENV, "mesh-secret-1")
    runtime = await serving()
    try:
        async with grpc.aio.insecure_channel(runtime.address) as outsider:
            stub = scheduler_pb2_grpc.SchedulerStub(outsider)
            for call in (
                stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_id="r1"), timeout=10),
                lanes_reply(stub),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert rich_error(refused.value).reason == "UNAUTHENTICATED"
            wrong = (("x-kvmesh-mesh-token", "mesh-secret-2"),)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Abort(scheduler_pb2.SchedulerAbortRequest(), metadata=wrong)
            health = health_pb2_grpc.HealthStub(outsider)  # probes carry no metadata
            await health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)
        async with aio_channel(runtime.address) as own:  # the mesh's: the token on each call
            stub = scheduler_pb2_grpc.SchedulerStub(own)
            request = scheduler_pb2.SchedulerAbortRequest(request_id="r1")
            assert (await stub.Abort(request, timeout=10)).found
            assert await lanes_reply(stub) == [3]
        with sync_channel(runtime.address) as blocking:  # in a thread: the server is this loop's
            request = scheduler_pb2.SchedulerAbortRequest(request_id="r1")
            abort = scheduler_pb2_grpc.SchedulerStub(blocking).Abort
            assert (await asyncio.to_thread(abort, request, timeout=10)).found
    finally:
        await runtime.server.stop(None)


async def test_public_servers_and_open_services_take_no_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(mesh_token.ENV, "mesh-secret-1")
    for runtime in (
        await serving(public=True),
        await serving(open_services=("kvmesh.v1.Scheduler",)),
    ):
        try:
            async with grpc.aio.insecure_channel(runtime.address) as outsider:
                request = scheduler_pb2.SchedulerAbortRequest(request_id="r1")
                stub = scheduler_pb2_grpc.SchedulerStub(outsider)
                assert (await stub.Abort(request, timeout=10)).found
        finally:
            await runtime.server.stop(None)


def test_a_new_token_is_long_and_random() -> None:
    made = {mesh_token.new_mesh_token() for _ in range(4)}
    assert len(made) == 4 and all(len(token) >= 32 for token in made)

"""`kvmesh up`'s supervisor: each service killed outright comes back on its own, same port, and
the mesh serves again; back-off doubles and starts over once a service stays up; a service
stopped on purpose stays down."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh
from kvmesh.mesh.supervisor import RESTARTS, BackOff, Supervisor
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from tests.e2e.mesh_helpers import (
    assert_one_terminal,
    collect,
    ids_request,
    tiny_mesh_config,
    wait_health,
)


class FakeService:
    def __init__(self, name: str) -> None:
        self.name, self.log_path, self.stopping = name, "-", False
        self.process = subprocess.Popen(["true"])
        self.process.wait()  # exited
        self.revived = 0

    def revive(self) -> bool:
        self.revived += 1
        self.process = subprocess.Popen(["sleep", "60"])
        return True


def test_back_off_doubles_and_starts_over_once_a_service_stays_up() -> None:
    service = FakeService("tokenizer")
    supervisor = Supervisor(lambda: [service], BackOff(1.0, 4.0, 10.0))  # type: ignore[list-item]
    assert supervisor.check(now=0.0) == []  # seen exited: restarts 1 s from now
    assert supervisor.check(now=1.0) == ["tokenizer"]
    for now, delay in ((2.0, 2.0), (5.0, 4.0), (10.0, 4.0)):  # 2 s, 4 s, capped at 4 s
        service.process.kill()
        service.process.wait()
        assert supervisor.check(now=now) == []
        assert supervisor.check(now=now + delay) == ["tokenizer"]
    service.process.kill()
    service.process.wait()
    assert supervisor.check(now=30.0) == []  # up 16 s > 10 s: back to 1 s
    assert supervisor.check(now=31.0) == ["tokenizer"]
    service.process.kill()
    service.process.wait()
    service.stopping = True  # stopped on purpose
    assert supervisor.check(now=40.0) == [] and supervisor.check(now=100.0) == []
    assert service.revived == 5


@pytest.fixture(scope="module")
def supervised_mesh(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("supervised-logs")))
    config.supervise = True
    config.back_off = BackOff(first_s=0.2, max_s=1.0, steady_s=5.0)
    with Mesh(config) as running:
        yield running


async def served(mesh: Mesh, timeout: float = 60) -> None:
    """A request completes through the gateway (retried while the mesh comes back)."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while True:
            try:
                events = await collect(stub, ids_request([3, 4, 5], max_tokens=4), timeout=10)
                if assert_one_terminal(events) == "completed":
                    return
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < deadline, "the mesh never served again"
            await asyncio.sleep(0.2)


async def test_every_service_killed_outright_comes_back_and_the_mesh_serves(
    supervised_mesh: Mesh,
) -> None:
    await served(supervised_mesh)
    names = ("engine-worker-0", "scheduler-0", "tokenizer", "trace-collector", "redis", "gateway")
    for name in names:
        service = supervised_mesh.service(name)
        before = RESTARTS.labels(name)._value.get()
        pid = service.process.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while service.process.pid == pid or service.process.poll() is not None:
            assert time.monotonic() < deadline, f"{name} was not restarted"
            time.sleep(0.05)
        assert RESTARTS.labels(name)._value.get() == before + 1
        if service.address is not None:
            await wait_health(service.address, serving=True)
        await served(supervised_mesh)

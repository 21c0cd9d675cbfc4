"""`python -m services.gateway --processes 2` (a container's gateway count, as Compose runs it)
in front of a sim-backend mesh: connections spread over both processes on the one port, each
has its own port and metrics, an Abort reaches the stream through the other, a killed process
is started again, and SIGTERM ends them all."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig
from kvmesh.mesh.service_process import free_port
from shared.pb.kvmesh.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import (
    assert_one_terminal,
    metric_value,
    read_rest,
    text_request,
    wait_health,
)

CONNECTIONS = 16  # all on one process by chance: 2^-15


def free_run(count: int) -> int:
    """A free port with the `count` ports after it free too."""
    for _ in range(50):
        first = free_port()
        sockets = [socket.socket() for _ in range(count)]
        try:
            if all(bind(sock, first + 1 + i) for i, sock in enumerate(sockets)):
                return first
        finally:
            for sock in sockets:
                sock.close()
    raise OSError("no run of free ports")


def bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def children_of(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue
        if int(fields.get("PPid", "0").strip()) == pid:
            found.append(int(status.parent.name))
    return sorted(found)


@dataclass
class Gateways:
    port: int  # shared; each process's own are port + 1 and port + 2
    metrics_port: int  # process i's: metrics_port + i
    parent: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    """Two gateway processes under one parent, in front of a mesh."""
    config = MeshConfig(
        worker_args=["--backend", "sim", "--sim-step-ms", "2", "--kv-memory", "64MiB"],
        log_dir=str(tmp_path_factory.mktemp("processes-logs")),
        drain_seconds=1,
    )
    with Mesh(config) as mesh:
        port, metrics = free_run(2), free_run(1)
        command = [
            *(sys.executable, "-m", "services.gateway", "--processes", "2"),
            *("--port", str(port), "--http-port", "0", "--metrics-port", str(metrics)),
            *("--scheduler", ",".join(mesh.scheduler_addresses)),
            *("--tokenizer", mesh.tokenizer_address, "--redis", mesh.redis_url or ""),
            "--drain-seconds",
            "1",
        ]
        log = open(Path(config.log_dir or ".") / "gateway-processes.log", "wb")  # noqa: SIM115
        parent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            for own in (port + 1, port + 2):
                asyncio.run(wait_health(f"127.0.0.1:{own}", serving=True))
            yield Gateways(port, metrics, parent)
        finally:
            if parent.poll() is None:
                parent.kill()  # its gateways see it gone and stop
            parent.wait()
            log.close()


async def generate(address: str, request: inference_pb2.GenerateRequest) -> list:
    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
    async with grpc.aio.insecure_channel(address, options=own) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return [event async for event in stub.Generate(request, timeout=30)]


async def test_connections_spread_over_the_processes(gateways: Gateways) -> None:
    port, metrics = gateways.port, gateways.metrics_port
    request = text_request("Why is the sky blue?", max_tokens=6, ignore_eos=True)
    # A process opens the shared port a moment after its own says SERVING.
    deadline = time.monotonic() + 20
    while True:
        try:
            await generate(f"127.0.0.1:{port}", request)
            break
        except grpc.aio.AioRpcError:
            assert time.monotonic() < deadline, "the shared port never served"
            await asyncio.sleep(0.1)
    shared = f"127.0.0.1:{port}"
    runs = await asyncio.gather(*(generate(shared, request) for _ in range(CONNECTIONS)))
    assert {assert_one_terminal(events) for events in runs} == {"completed"}
    served = [
        metric_value(f"http://127.0.0.1:{metrics + i}/metrics", "kvmesh_admitted_total")
        for i in range(2)
    ]
    assert sum(served) == CONNECTIONS + 1 and all(count > 0 for count in served), served


async def test_an_abort_through_one_process_ends_the_stream_on_the_other(
    gateways: Gateways,
) -> None:
    port = gateways.port
    long = text_request("Tell me a long story.", max_tokens=2000, ignore_eos=True)
    long.request_id = f"processes-abort-{time.monotonic_ns()}"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port + 1}") as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(long)
        while not (await call.read()).HasField("delta"):
            pass
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port + 2}") as other:
            abort = inference_pb2.AbortRequest(request_id=long.request_id)
            assert (await inference_pb2_grpc.InferenceStub(other).Abort(abort)).found
        rest = await read_rest(call)
    assert rest[-1].cancelled.reason == "abort"


async def test_a_killed_process_is_started_again(gateways: Gateways) -> None:
    port, parent = gateways.port, gateways.parent.pid
    before = children_of(parent)
    assert len(before) == 2
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while len(after := children_of(parent)) < 2 or before[0] in after:
        assert time.monotonic() < deadline, "the killed gateway was not started again"
        await asyncio.sleep(0.1)
    for own in (port + 1, port + 2):
        await wait_health(f"127.0.0.1:{own}", serving=True)


def test_sigterm_drains_every_process_and_ends_the_parent(gateways: Gateways) -> None:
    children = children_of(gateways.parent.pid)
    gateways.parent.send_signal(signal.SIGTERM)
    assert gateways.parent.wait(timeout=20) == 0
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]

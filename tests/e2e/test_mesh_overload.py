"""Admission under overload: offered 3x what the mesh can serve, every request gets a full
answer or an OVERLOADED refusal with RetryInfo, memory stays flat and every block comes back.
The default model, so the engine-workers (not the test's own client) are what runs out of
capacity. How fast (TTFT against the SLO, refusal latency) is `make bench-overload`'s to
print: a test asserts behaviour, never a duration."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import psutil
import pytest

from kvmesh.mesh.launcher import Mesh
from loadtest.overload_bench import closed_loop_rate, offer, overload_mesh_config
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from tests.e2e.mesh_helpers import settled_load


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with Mesh(overload_mesh_config(str(tmp_path_factory.mktemp("mesh-overload-logs")))) as running:
        yield running


def _rss_mb(mesh: Mesh, names: list[str]) -> dict[str, float]:
    return {n: psutil.Process(mesh.service(n).process.pid).memory_info().rss / 2**20 for n in names}


async def test_three_times_capacity_gets_answers_or_overloaded_with_retry_info(
    mesh: Mesh,
) -> None:
    services = ["gateway", "scheduler-0", "scheduler-1", "redis"]
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        capacity = await closed_loop_rate(stub, 5.0)
        memory_before = _rss_mb(mesh, services)
        outcomes = await offer(stub, 3 * capacity, 6.0)
    memory_after = _rss_mb(mesh, services)
    completed = [o for o in outcomes if o.kind == "completed"]
    refused = [o for o in outcomes if o.kind == "OVERLOADED"]
    others = [o.kind for o in outcomes if o.kind not in ("completed", "OVERLOADED")]
    assert not others, others
    assert completed and refused
    assert all(o.retry_ms >= 100 for o in refused)
    for name in services:
        assert memory_after[name] - memory_before[name] < 40, (name, memory_before, memory_after)
    for address in mesh.scheduler_addresses:
        load = await settled_load(address)
        assert load.num_free_blocks == load.num_blocks

"""A real mesh on loopback (real processes, real redis-server), shared by the e2e modules."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig

# A small KV pool: the test process (which also loads an in-process engine) shares the machine.
MESH_WORKER_ARGS = ["--kv-memory", "256MiB"]


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        worker_threads=2,
        worker_args=MESH_WORKER_ARGS,
        # The GPU default, on this CPU mesh: every e2e test on it runs with steps planned ahead
        # (the meshes other tests start plan in lock-step, the CPU default).
        scheduler_args=["--plan-ahead", "on"],
        log_dir=str(tmp_path_factory.mktemp("mesh-logs")),
        drain_seconds=5,
    )
    with Mesh(config) as running:
        yield running


@pytest.fixture
async def client(mesh: Mesh):
    """The official `openai` client on the shared mesh's OpenAI front."""
    async with openai.AsyncOpenAI(base_url=mesh.http_url, api_key="unused", max_retries=0) as c:
        yield c

"""The whole mesh on `--backend sim`: `kvmesh up`'s flags reach the worker, text streams through
the real tokenizer, scheduler and gateway at the simulated step time, and the model says it is
simulated (ModelInfo, `/v1/models`)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from kvmesh.cli import build_parser as kvmesh_parser
from kvmesh.client import MeshClient, generate_request
from kvmesh.mesh.launcher import Mesh, MeshConfig
from kvmesh.mesh.settings import service_args
from services.engine_worker.config import build_parser, engine_config
from shared.config import SimConfig
from shared.runtime.settings import WORKER

SIM = ["--backend", "sim", "--sim-step-ms", "1.5", "--sim-prefill-ms-per-1k-tokens", "4"]


def test_kvmesh_up_forwards_the_sim_flags_to_its_workers() -> None:
    up = kvmesh_parser().parse_args(["up", *SIM])
    config = engine_config(build_parser().parse_args(service_args(up, WORKER)))
    assert (config.backend, config.sim) == ("sim", SimConfig(1.5, 4.0))


@pytest.fixture(scope="module")
def sim_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        worker_args=[*SIM, "--kv-memory", "64MiB"],
        log_dir=str(tmp_path_factory.mktemp("sim-mesh-logs")),
        drain_seconds=2,
    )
    with Mesh(config) as running:
        yield running


def test_text_streams_through_the_mesh_on_the_sim_backend(sim_mesh: Mesh) -> None:
    request = generate_request("Why is the sky blue?", max_tokens=24, seed=5, ignore_eos=True)
    with MeshClient(sim_mesh.gateway_address) as client:
        events = [list(client.stream(request, timeout=30)) for _ in range(2)]
        models = client.models()
    texts = ["".join(e.delta.text for e in run if e.HasField("delta")) for run in events]
    tokens = [sum(len(e.delta.token_ids) for e in run if e.HasField("delta")) for run in events]
    assert tokens == [24, 24] and texts[0] == texts[1] and texts[0]  # seeded: the same text
    assert events[0][-1].HasField("completed")
    assert [model.backend for model in models] == ["sim"]
    with urllib.request.urlopen(f"{sim_mesh.http_url}/models", timeout=10) as page:
        listed = json.loads(page.read())["data"]
    assert {entry["backend"] for entry in listed} == {"sim"}

"""A GenerateRequest followed through the real mesh: its sampling parameters are validated
once, at the gateway, and decoded once per hop (docs/request-path.md)."""

from __future__ import annotations

import collections
import os
import pathlib
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    assert_one_terminal,
    collect,
    ids_request,
    tiny_mesh_config,
)

AUDIT_DIR = pathlib.Path(__file__).parent / "codec_audit"


@pytest.fixture(scope="module")
def audited_mesh(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[tuple[Mesh, pathlib.Path]]:
    log = tmp_path_factory.mktemp("codec-audit") / "calls.log"
    with pytest.MonkeyPatch.context() as env:  # the mesh's processes inherit both
        env.setenv("PYTHONPATH", str(AUDIT_DIR), prepend=os.pathsep)
        env.setenv("KVMESH_TEST_CODEC_LOG", str(log))
        config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("audit-logs")))
        with Mesh(config) as mesh:
            yield mesh, log


def _calls(log: pathlib.Path) -> collections.Counter[str]:
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return collections.Counter(lines)


async def test_sampling_is_validated_once_and_decoded_once_per_hop(
    audited_mesh: tuple[Mesh, pathlib.Path],
) -> None:
    mesh, log = audited_mesh
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        warm = await collect(stub, ids_request([1, 2, 3], max_tokens=2, temperature=0.0))
        assert assert_one_terminal(warm) == "completed"
        await assert_mesh_idle(mesh)
        before = _calls(log)
        request = ids_request([5, 6, 7, 8, 9], max_tokens=4, temperature=0.7, top_p=0.9, seed=3)
        events = await collect(stub, request)
        assert assert_one_terminal(events) == "completed"
        await assert_mesh_idle(mesh)
    calls = _calls(log) - before
    assert calls == {
        # gateway: the request's sampling decoded (defaults merged), validated, encoded once
        # for the SubmitRequest (the execution record reuses the same message)
        "gateway decode": 1,
        "gateway validate": 1,
        "gateway encode": 1,
        # scheduler: decoded from the SubmitRequest, encoded into the new request's plan
        "scheduler decode": 1,
        "scheduler encode": 1,
        # engine-worker: decoded from the plan; trusted, never validated again
        "engine_worker decode": 1,
    }
    completed = events[-1].completed
    assert completed.execution.sampling.top_p == pytest.approx(0.9)  # what ran, recorded
    assert completed.execution.seed == 3

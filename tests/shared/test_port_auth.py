"""Auth on the ports beside the API: a metrics endpoint wants the scrape token when one is set,
and `kvmesh up`'s control port an admin tenant's key when auth is on."""

from __future__ import annotations

import pathlib
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.control_server import serve_control
from kvmesh.mesh.rollout import RolloutStep
from kvmesh.mesh.service_process import free_port
from shared.pb.kvmesh.v1 import mesh_control_pb2, mesh_control_pb2_grpc
from shared.runtime.metrics import serve_metrics
from shared.tenants import ApiKeys
from tests.e2e.mesh_helpers import rich_error

KEYS = """
[tenants.acme]
keys = ["sk-acme"]

[tenants.ops]
keys = ["sk-ops"]
admin = true
"""


def status(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def test_a_metrics_endpoint_wants_the_scrape_token_when_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVMESH_METRICS_TOKEN", "scrape-7f3a")
    port = free_port()
    serve_metrics("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/metrics"
    assert status(url, None) == 401
    assert status(url, "wrong") == 401
    assert status(url, "scrape-7f3a") == 200


class Controller:
    def deploy(self, model: str, version: str, canary: float | None) -> Iterator[RolloutStep]:
        yield RolloutStep(f"deployed {model}@{version}", done=True)

    def rollback(self, model: str) -> Iterator[RolloutStep]:
        yield RolloutStep(f"rolled back {model}", done=True)


def test_the_control_port_wants_an_admins_key_when_auth_is_on(tmp_path: pathlib.Path) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS)
    address = f"127.0.0.1:{free_port()}"
    server = serve_control(Controller(), address, ApiKeys.from_toml(str(keys_file)))  # type: ignore[arg-type]
    try:
        with grpc.insecure_channel(address) as channel:
            control = mesh_control_pb2_grpc.MeshControlStub(channel)
            request = mesh_control_pb2.RollbackRequest(model="smollm2")
            for metadata, reason in ((None, "UNAUTHENTICATED"), ("sk-acme", "PERMISSION_DENIED")):
                sent = (("authorization", f"Bearer {metadata}"),) if metadata else None
                with pytest.raises(grpc.RpcError) as refused:
                    list(control.Rollback(request, metadata=sent))
                assert rich_error(refused.value).reason == reason
            events = list(control.Rollback(request, metadata=(("authorization", "Bearer sk-ops"),)))
            assert events[-1].done and events[-1].message == "rolled back smollm2"
    finally:
        server.stop(grace=None)

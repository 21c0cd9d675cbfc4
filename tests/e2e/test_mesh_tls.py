"""TLS on the public endpoints, mTLS between services: a tiny-model mesh whose every hop is
encrypted with certificates from a CA generated here. A client without a valid certificate
cannot reach an internal service; the public gateway serves TLS to clients with none."""

from __future__ import annotations

import os
import pathlib
import ssl
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.mesh_helpers import assert_one_terminal, ids_request, tiny_mesh_config
from tests.tls_certs import CertificateAuthority


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    directory = tmp_path_factory.mktemp("pki")
    mesh_ca, rogue_ca = (
        CertificateAuthority(directory, "mesh-ca"),
        CertificateAuthority(directory, "rogue-ca"),
    )
    service, rogue = mesh_ca.issue("service"), rogue_ca.issue("rogue")
    return {
        "ca": mesh_ca.issued.cert,
        "cert": service.cert,
        "key": service.key,
        "rogue_cert": rogue.cert,
        "rogue_key": rogue.key,
    }


@pytest.fixture(scope="module")
def tls_mesh(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory, pki: dict[str, pathlib.Path]
) -> Iterator[Mesh]:
    # Every service (and this process's launcher, for its readiness checks) reads these.
    settings = {
        "KVMESH_TLS_CERT": str(pki["cert"]),
        "KVMESH_TLS_KEY": str(pki["key"]),
        "KVMESH_TLS_CA": str(pki["ca"]),
    }
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("tls-logs")))
        with Mesh(config) as running:
            yield running
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def credentials(pki: dict[str, pathlib.Path], who: str | None) -> grpc.ChannelCredentials:
    if who is None:  # verifies the server, presents nothing
        return grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
    prefix = "" if who == "mesh" else "rogue_"
    return grpc.ssl_channel_credentials(
        root_certificates=pki["ca"].read_bytes(),
        private_key=pki[f"{prefix}key"].read_bytes(),
        certificate_chain=pki[f"{prefix}cert"].read_bytes(),
    )


async def scheduler_load(address: str, creds: grpc.ChannelCredentials | None):
    channel = (
        grpc.aio.insecure_channel(address)
        if creds is None
        else grpc.aio.secure_channel(address, creds)
    )
    async with channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return await stub.GetLoad(scheduler_pb2.LoadRequest(), timeout=5)


async def test_the_mesh_serves_over_tls_end_to_end(tls_mesh: Mesh, pki) -> None:
    async with grpc.aio.secure_channel(
        tls_mesh.gateway_address, credentials(pki, None)
    ) as channel:  # a public client: no certificate of its own
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = ids_request([1, 2, 3], max_tokens=4, ignore_eos=True)
        events = [e async for e in stub.Generate(request, timeout=30)]
    assert assert_one_terminal(events) == "completed"
    log = pathlib.Path(tls_mesh.service("scheduler-0").log_path).read_text()
    assert '"tls": true' in log


async def test_a_plaintext_client_is_refused_everywhere(tls_mesh: Mesh) -> None:
    for address in (tls_mesh.gateway_address, tls_mesh.scheduler_addresses[0]):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await scheduler_load(address, None)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("who", [None, "rogue"], ids=["no-certificate", "another-ca"])
async def test_an_internal_service_refuses_a_client_without_a_valid_certificate(
    tls_mesh: Mesh, pki, who: str | None
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await scheduler_load(tls_mesh.scheduler_addresses[0], credentials(pki, who))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    load = await scheduler_load(tls_mesh.scheduler_addresses[0], credentials(pki, "mesh"))
    assert load.worker_ready  # the same call with the mesh's certificate


def test_the_http_front_serves_https(tls_mesh: Mesh, pki) -> None:
    assert tls_mesh.http_url.startswith("https://")
    url = tls_mesh.http_url.removesuffix("/v1") + "/health"
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    with urllib.request.urlopen(url, context=context, timeout=10) as reply:
        assert reply.status == 200

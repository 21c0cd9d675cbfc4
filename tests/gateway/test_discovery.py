"""Schedulers found by DNS (a headless Service): added as names resolve, removed as they go."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.mesh.discovery import DnsDiscovery, is_dns_spec, resolve
from services.gateway.mesh.registry import BackendRegistry
from services.gateway.mesh.tokenizer_link import TokenizerLink
from shared.errors import KvmeshError, Reason


async def test_addresses_come_and_go_with_the_name() -> None:
    answers = [{"10.0.0.1:50071", "10.0.0.2:50071"}, {"10.0.0.2:50071", "10.0.0.3:50071"}]

    async def resolver(host: str, port: int) -> set[str]:
        assert (host, port) == ("worker.kvmesh.svc", 50071)
        return answers.pop(0)

    backends = BackendRegistry(
        TokenizerLink("127.0.0.1:1"), ["smollm2=dns:///worker.kvmesh.svc:50071"]
    )
    assert backends.schedulers == [] and len(backends.discoveries) == 1
    catalog = ModelCatalog(backends)
    for model in ("", "smollm2"):  # nothing resolved yet: loading, not unknown
        with pytest.raises(KvmeshError) as loading:
            catalog.serving(model)
        assert loading.value.reason is Reason.MODEL_NOT_READY and loading.value.retryable
    discovery = DnsDiscovery(backends, "smollm2=dns:///worker.kvmesh.svc:50071", resolver=resolver)
    await discovery.refresh()
    assert {s.address for s in backends.schedulers} == {"10.0.0.1:50071", "10.0.0.2:50071"}
    assert {s.declared_name for s in backends.schedulers} == {"smollm2"}
    await discovery.refresh()  # .1 left the Service: removed once its streams here ended (none)
    await asyncio.sleep(0.1)
    assert {s.address for s in backends.schedulers} == {"10.0.0.2:50071", "10.0.0.3:50071"}
    await discovery.close()
    await backends.close()


async def test_a_failed_lookup_keeps_what_is_known() -> None:
    async def failing(host: str, port: int) -> set[str]:
        raise OSError("temporary failure in name resolution")

    backends = BackendRegistry(TokenizerLink("127.0.0.1:1"), [])
    discovery = DnsDiscovery(backends, "dns:///worker:50071", resolver=failing)
    discovery.known = {"10.0.0.9:50071"}
    await discovery.refresh()
    assert discovery.known == {"10.0.0.9:50071"}
    await backends.close()


async def test_localhost_resolves_to_loopback() -> None:
    assert "127.0.0.1:4242" in await resolve("localhost", 4242)
    assert is_dns_spec("m@2=dns:///worker:1") and not is_dns_spec("m@2=10.0.0.1:1")


def test_a_dns_target_is_host_and_port_and_a_bad_peers_spec_fails_at_start() -> None:
    from services.gateway.mesh.discovery import dns_target
    from services.gateway.mesh.peers import PeerGateways

    assert dns_target("dns:///gateway-peers.kvmesh.svc:50051") == (
        "gateway-peers.kvmesh.svc",
        50051,
    )
    for bad in ("gateway:50051", "dns:///gateway", "dns:///:50051"):
        with pytest.raises(ValueError):
            dns_target(bad)
    with pytest.raises(ValueError):
        PeerGateways("dns:///gateway-peers", "127.0.0.1:1")

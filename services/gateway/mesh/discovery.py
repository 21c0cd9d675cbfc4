"""Schedulers found by DNS: `dns:///HOST:PORT`, every address HOST resolves to (a Kubernetes
headless Service resolves to each ready pod), re-resolved every few seconds.

A new address is added (routed to once its health says SERVING); a vanished one is removed once
its streams through this gateway ended: a pod leaves its Service's DNS when it stops being
ready, which its SIGTERM drain does first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger("kvmesh.gateway.discovery")
Resolver = Callable[[str, int], Awaitable[set[str]]]
DNS_PREFIX = "dns:///"
DRAIN_TIMEOUT_S = 120.0


class BackendSet(Protocol):
    """What discovery changes: the gateway's registry of backends."""

    async def add(self, address: str, name: str, version: str) -> None: ...

    async def remove(self, address: str, drain_timeout_s: float) -> int: ...


def is_dns_spec(spec: str) -> bool:
    return spec.rpartition("=")[2].startswith(DNS_PREFIX)


def dns_target(target: str) -> tuple[str, int]:
    """`dns:///HOST:PORT` as (HOST, PORT); ValueError for anything else."""
    host, _, port = target.removeprefix(DNS_PREFIX).rpartition(":")
    if not target.startswith(DNS_PREFIX) or not host or not port.isdigit():
        raise ValueError(f"{target!r}: expected dns:///HOST:PORT")
    return host, int(port)


async def resolve(host: str, port: int) -> set[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    found = set()
    for family, _, _, _, address in infos:
        ip = address[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return found


class DnsDiscovery:
    def __init__(
        self,
        backends: BackendSet,
        spec: str,
        interval_s: float = 5.0,
        resolver: Resolver = resolve,
    ) -> None:
        model, _, target = spec.rpartition("=")
        self.name, _, self.version = model.partition("@")
        try:
            self.host, self.port = dns_target(target)
        except ValueError:
            raise ValueError(f"{spec!r}: expected [NAME[@VERSION]=]dns:///HOST:PORT") from None
        self.backends = backends
        self.interval_s = interval_s
        self.resolver = resolver
        self.known: set[str] = set()
        self._removals: set[asyncio.Task[int]] = set()

    async def refresh(self) -> None:
        try:
            found = await self.resolver(self.host, self.port)
        except OSError as error:  # keep what we have: a DNS hiccup is not a fleet going away
            log.warning("dns lookup failed", extra={"host": self.host, "error": str(error)})
            return
        for address in sorted(found - self.known):
            await self.backends.add(address, self.name, self.version)
        for address in sorted(self.known - found):
            removal = asyncio.create_task(self.backends.remove(address, DRAIN_TIMEOUT_S))
            self._removals.add(removal)
            removal.add_done_callback(self._removals.discard)
        if found != self.known:
            log.info("schedulers from dns", extra={"host": self.host, "count": len(found)})
        self.known = found

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        for removal in list(self._removals):
            removal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await removal

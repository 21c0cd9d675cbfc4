"""The mesh's other gateways, for an Abort that reaches one not holding the request: gateways
that share a port (or a Kubernetes Service) get each call from whichever the kernel or the
balancer picked, so the `Abort` for a stream may land beside the gateway that streams it. That
gateway asks its peers, each at its own port, with the caller's key (each peer checks it: a
tenant still aborts only its own) and a mark that stops the question going further.

Peers are `HOST:PORT,...` (the launcher passes every gateway's own port) or `dns:///HOST:PORT`
(a headless Service: every address it resolves to, looked up at each Abort: they are rare)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from services.gateway.mesh.discovery import DNS_PREFIX, dns_target, resolve
from shared.pb.kvmesh.v1 import inference_pb2, inference_pb2_grpc
from shared.runtime.service import CHANNEL_OPTIONS
from shared.runtime.tls import aio_channel

log = logging.getLogger("kvmesh.gateway.peers")
FORWARDED = "kvmesh-forwarded"  # metadata on an Abort one gateway asks of another
FORWARDED_HEADERS = ("authorization", "x-api-key")  # what a peer authenticates by
PEER_TIMEOUT_S = 5.0

Metadata = Sequence[tuple[str, str | bytes]]


def forwarded(metadata: Metadata | None) -> bool:
    return any(name == FORWARDED for name, _ in metadata or ())


class PeerGateways:
    def __init__(self, spec: str, own_address: str) -> None:
        self.spec = spec
        self.own_address = own_address
        # A headless Service's name, checked at start; else the addresses themselves.
        self.dns = dns_target(spec) if spec.startswith(DNS_PREFIX) else None
        self._stubs: dict[str, inference_pb2_grpc.InferenceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def addresses(self) -> list[str]:
        if self.dns is not None:
            try:
                found = sorted(await resolve(*self.dns))
            except OSError as error:
                log.warning("peer lookup failed", extra={"peers": self.spec, "error": str(error)})
                return []
        else:
            found = [address for address in self.spec.split(",") if address]
        return [address for address in found if address != self.own_address]

    async def abort(self, request: inference_pb2.AbortRequest, metadata: Metadata | None) -> bool:
        """Whether a peer held the request (and aborted it)."""
        ask = [(name, value) for name, value in metadata or () if name in FORWARDED_HEADERS] + [
            (FORWARDED, "1")
        ]
        replies = await asyncio.gather(
            *(self._abort_at(address, request, ask) for address in await self.addresses())
        )
        return any(replies)

    async def _abort_at(
        self, address: str, request: inference_pb2.AbortRequest, metadata: Metadata
    ) -> bool:
        stub = self._stubs.get(address)
        if stub is None:
            channel = aio_channel(address, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[address] = inference_pb2_grpc.InferenceStub(channel)
        try:
            reply = await stub.Abort(request, metadata=metadata, timeout=PEER_TIMEOUT_S)
        except grpc.RpcError as error:  # a peer down or draining holds nothing to abort
            code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else str(error)
            log.warning("peer abort failed", extra={"peer": address, "error": code})
            return False
        return reply.found

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

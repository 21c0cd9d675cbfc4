"""A call made on every gateway of the mesh, each at its own port.

Gateways sharing the public port (gateways.py) each hold their own view of the model
versions they route to, so a rollout's ModelAdmin calls and its readiness checks go to each of
them: a call through the shared port would reach one, chosen by the kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from shared.runtime.tls import sync_channel


class EveryGateway:
    """`every.SetTraffic(request, ...)` calls SetTraffic on each gateway, in turn; the
    replies, one a gateway."""

    def __init__(self, stubs: list[Any]) -> None:
        self._stubs = stubs

    def __getattr__(self, method: str) -> Callable[..., list[Any]]:
        def call(*args: Any, **kwargs: Any) -> list[Any]:
            return [getattr(stub, method)(*args, **kwargs) for stub in self._stubs]

        return call


@contextlib.contextmanager
def every_gateway(addresses: list[str], *stub_types: type) -> Iterator[list[EveryGateway]]:
    """An EveryGateway per stub type, over one channel to each gateway's own address."""
    with contextlib.ExitStack() as channels:
        opened = [channels.enter_context(sync_channel(address)) for address in addresses]
        yield [EveryGateway([stub(channel) for channel in opened]) for stub in stub_types]

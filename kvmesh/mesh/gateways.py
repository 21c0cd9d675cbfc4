"""How many gateways and tokenizers one host runs, their names and their ports.

One gateway process carries 6,600-8,000 streamed tokens a second per core (`make
bench-mesh-ceiling`), a GPU makes ten times that: a host runs several, as NGINX runs workers.
They share the public gRPC port and the HTTP port (SO_REUSEPORT: the kernel spreads the
connections among them), each with a gRPC port of its own beside it (the launcher's health
checks, one gateway's Abort or metrics), and its own lanes to every scheduler and to one
tokenizer (gateway i to tokenizer i mod M). What must be global already is: rate limits and
concurrency leases live in Redis, generated request ids are random, load and prefix hits come
from Redis. A single gateway (the default on two cores) keeps the one port it always had.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from kvmesh.mesh.config import MeshConfig
from kvmesh.mesh.service_process import ServiceProcess, free_port
from services.gateway.config import SHARING_PORTS

Spawn = Callable[..., str]  # Mesh.spawn: (name, module, args, port=) -> its own address

CORES_PER_GATEWAY = 4  # the rest of the host's cores go to the schedulers and workers
GATEWAYS_PER_TOKENIZER = 2  # a tokenizer costs a seventh of a gateway per token


def default_gateways(cores: int | None = None) -> int:
    """One gateway per four cores, one on a 2-core machine."""
    return max(1, (cores or os.cpu_count() or 1) // CORES_PER_GATEWAY)


def default_tokenizers(gateways: int) -> int:
    return max(1, gateways // GATEWAYS_PER_TOKENIZER)


def names(stage: str, count: int) -> list[str]:
    """`gateway` alone, or `gateway-0` ... `gateway-{count-1}`."""
    return [stage] if count == 1 else [f"{stage}-{i}" for i in range(count)]


def stage_of(process: str) -> str:
    """A process's stage: `gateway` and `gateway-1` are gateways, `scheduler-0` a scheduler."""
    stage, _, index = process.rpartition("-")
    return stage if index.isdigit() else process


def start(config: MeshConfig, spawn: Spawn, tokenizers: list[str], args: list[str]) -> str:
    """The mesh's gateways, each started with `args` (not waited for); the address clients
    use: the shared port's, or the one gateway's."""
    count = config.gateways
    if count == 1:
        own = config.gateway_port or None
        return spawn("gateway", "services.gateway", ["--tokenizer", tokenizers[0], *args], port=own)
    shared = config.gateway_port or free_port(config.host)
    ports = [free_port(config.host) for _ in range(count)]
    peers = ",".join(f"{config.host}:{port}" for port in ports)  # each skips its own
    for index, name in enumerate(names("gateway", count)):
        tokenizer = tokenizers[index % len(tokenizers)]
        gateway_args = ["--tokenizer", tokenizer, "--shared-port", str(shared), "--peers", peers]
        spawn(name, "services.gateway", [*gateway_args, *args], port=ports[index])
    return f"{config.host}:{shared}"


def wait_sharing(gateways: Sequence[ServiceProcess], deadline: float) -> None:
    """Until each of several gateways serves the shared ports: each opens them once ready, a
    moment after its own port says SERVING."""
    for gateway in gateways if len(gateways) > 1 else ():
        while not gateway.has_logged(SHARING_PORTS):
            if gateway.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{gateway.name} never opened the shared ports")
            time.sleep(0.05)

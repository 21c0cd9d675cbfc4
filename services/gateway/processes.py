"""`--processes N`: one gateway container runs N gateway processes, as vLLM's
`--api-server-count` and NGINX's workers do: one Python process carries 6,600-8,000 streamed
tokens a second, a GPU makes ten times that.

This process then serves nothing itself. It starts N gateways with its own settings: they share
`--port` and `--http-port` (SO_REUSEPORT, as `kvmesh up --gateways N` runs them), each also
listens on `--port` + 1 + i of its own (its health, its peers' Abort) and serves its metrics on
`--metrics-port` + i. A gateway that exits is started again (after 1 s, doubling to 30 s, back
to 1 s once it stayed up a minute); SIGTERM or SIGINT is passed on, and this process exits once
they all have, each having drained its own streams.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from shared.runtime.parent_watch import PARENT_ENV
from shared.runtime.restarts import BackOff, RestartClock

log = logging.getLogger("kvmesh.gateway.processes")
POLL_S = 0.2


def commands(args: argparse.Namespace, argv: Sequence[str]) -> list[list[str]]:
    """Each gateway's command line: this one's arguments, then what sets it apart (a flag given
    twice takes its last value)."""
    own_ports = [args.port + 1 + index for index in range(args.processes)]
    peers = ",".join(f"{args.host}:{port}" for port in own_ports)
    result = []
    for index, own in enumerate(own_ports):
        apart = ["--processes", "1", "--port", str(own), "--shared-port", str(args.port)]
        apart += ["--peers", peers]
        if args.metrics_port:
            apart += ["--metrics-port", str(args.metrics_port + index)]
        result.append([sys.executable, "-m", "services.gateway", *argv, *apart])
    return result


@dataclass
class Child:
    command: list[str]
    process: subprocess.Popen[bytes]
    clock: RestartClock


def start(command: list[str]) -> subprocess.Popen[bytes]:
    # Each watches this process: killed outright, it takes its gateways along.
    return subprocess.Popen(command, env={**os.environ, PARENT_ENV: str(os.getpid())})


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    now = time.monotonic()
    children = [Child(c, start(c), RestartClock(BackOff(), now)) for c in commands(args, argv)]
    log.info("gateway processes started", extra={"count": len(children), "port": args.port})
    stopping: list[int] = []

    def pass_on(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    while not stopping:
        restart_exited(children, time.monotonic())
        time.sleep(POLL_S)
    for child in children:
        child.process.wait()
    return 0


def restart_exited(children: list[Child], now: float) -> None:
    for index, child in enumerate(children):
        if child.process.poll() is None:
            continue
        if child.clock.restart_at is None:
            log.warning(
                "gateway process exited; restarting",
                extra={
                    "index": index,
                    "status": child.process.returncode,
                    "in_s": child.clock.exited(now),
                },
            )
        elif child.clock.due(now):
            child.process = start(child.command)
            child.clock.restarted(now)

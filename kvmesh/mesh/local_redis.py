"""The redis-server a local mesh starts for itself: its command line, and waiting for PONG."""

from __future__ import annotations

import shutil
import socket
import time

from shared.errors import KvmeshError, Reason


def redis_command(host: str, port: int) -> list[str]:
    """No persistence: all kvmesh keeps in Redis is soft state with TTLs."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            "redis-server is not on PATH: install it (apt-get install redis-server) "
            "or point at a running one with --redis redis://HOST:PORT",
        )
    return [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]


def wait_for_redis(host: str, port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise KvmeshError(Reason.INTERNAL, "redis-server did not start")
        time.sleep(0.05)

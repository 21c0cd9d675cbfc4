"""The redis-server a local mesh starts for itself: its command line, and waiting for PONG."""

from __future__ import annotations

import os
import shutil
import socket
import time

from shared import redis_auth
from shared.errors import KvmeshError, Reason


def redis_command(host: str, port: int, password: str = "", config_dir: str = "") -> list[str]:
    """No persistence: all kvmesh keeps in Redis is soft state with TTLs. With `password`: an
    ACL user `kvmesh` holding it and the default user off, from a file only we can read in
    `config_dir` (a password in argv is anyone's who runs `ps`)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            "redis-server is not on PATH: install it (apt-get install redis-server) "
            "or point at a running one with --redis redis://HOST:PORT",
        )
    command = [binary]
    if password:
        path = os.path.join(config_dir, "redis.conf")
        acl = f"user default off\nuser {redis_auth.MESH_USER} on >{password} ~kvmesh:* +@all\n"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(acl)
        command.append(path)
    return [*command, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]


def wait_for_redis(host: str, port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up, maybe locked
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise KvmeshError(Reason.INTERNAL, "redis-server did not start")
        time.sleep(0.05)

"""One local service process of the mesh: started with its log file, waited on until its
health says SERVING, restarted in place, stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.errors import KvmeshError, Reason
from shared.runtime.parent_watch import PARENT_ENV, parent_death_signal
from shared.runtime.tls import sync_channel

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
PROGRESS_EVERY_S = 20.0  # how often a start that is still waiting says so, and why
LOWEST_LISTEN_PORT = 10000
_handed_out: set[int] = set()  # never the same port twice from one launcher


def _lowest_ephemeral_port() -> int:
    try:
        with open(EPHEMERAL_RANGE) as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port a child process can listen on. It is free now, not reserved: so it is picked
    below the kernel's ephemeral range, where the source port of an outgoing connection (a
    gRPC client's, anywhere on the machine) cannot take it before the child binds it."""
    low = _lowest_ephemeral_port()
    for _ in range(100):
        port = random.randrange(LOWEST_LISTEN_PORT, low) if low > LOWEST_LISTEN_PORT else 0
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            port = int(probe.getsockname()[1])
        _handed_out.add(port)
        return port
    raise OSError(f"no free port to listen on below {low}")


def _spawn(command: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
    # Ctrl-C reaches the launcher only (a session of its own); it stops them in order. Killed
    # outright, the launcher takes them along: ours watch it, redis-server gets the kernel's
    # parent-death signal.
    ours = command[0] == sys.executable
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, PARENT_ENV: str(os.getpid())},
            start_new_session=True,
            preexec_fn=None if ours else parent_death_signal(),
        )


@dataclass
class ServiceProcess:
    name: str
    address: str | None  # gRPC address; None for redis
    process: subprocess.Popen[bytes]
    log_path: str
    command: list[str]
    env: dict[str, str]
    metrics_url: str | None = None  # its Prometheus endpoint
    stopping: bool = False  # stopped on purpose: never restarted by the supervisor
    # Held while its process is replaced: a supervisor's restart and a caller's never overlap.
    _replacing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def start(
        cls, name: str, address: str | None, command: list[str], env: dict, log_path: str
    ) -> ServiceProcess:
        return cls(name, address, _spawn(command, env, log_path), log_path, command, env)

    @property
    def grpc_address(self) -> str:
        if self.address is None:
            raise ValueError(f"{self.name} serves no gRPC")
        return self.address

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])

    def has_logged(self, message: str) -> bool:
        """Whether a line of its log carries `message` (read whole: for start-up lines)."""
        return self.logged(message) is not None

    def logged(self, message: str) -> dict[str, object] | None:
        """The first log record that carries `message`, with its fields; None if none does."""
        with open(self.log_path, errors="replace") as handle:
            for line in handle:
                if f'"msg": "{message}"' in line:
                    try:
                        return dict(json.loads(line))
                    except ValueError:
                        return {"msg": message}
        return None

    def last_message(self) -> str:
        """Its log's last message (the text of a JSON log line)."""
        tail = self.log_tail(1).strip()
        try:
            return str(json.loads(tail).get("msg", tail))
        except (ValueError, AttributeError):
            return tail

    def restart(self) -> None:
        """Same command, same port (SIGKILL first if it still runs)."""
        with self._replacing:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.stopping = False
            self.process = _spawn(self.command, self.env, self.log_path)

    def revive(self) -> bool:
        """Starts it again, same command and port, if it exited and was not stopped on
        purpose; whether it did."""
        with self._replacing:
            if self.stopping or self.process.poll() is None:
                return False
            self.process = _spawn(self.command, self.env, self.log_path)
            return True

    def wait_ready(self, deadline: float, health_name: str = "") -> None:
        """Until its health says SERVING (`health_name` "": ready; LIVENESS: listening);
        refused at once when it exits, or at the deadline."""
        started = time.monotonic()
        next_note = started + PROGRESS_EVERY_S
        with sync_channel(self.grpc_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if time.monotonic() > next_note:  # a long first start is not silent
                    waited = time.monotonic() - started
                    note = f"kvmesh: {self.name} not ready after {waited:.0f}s"
                    print(f"{note}: {self.last_message()}", file=sys.stderr, flush=True)
                    next_note += PROGRESS_EVERY_S
                if self.process.poll() is not None:
                    raise KvmeshError(
                        Reason.INTERNAL,
                        f"{self.name} exited with {self.process.returncode}; "
                        f"its log ({self.log_path}) ends:\n{self.log_tail()}",
                    )
                try:
                    request = health_pb2.HealthCheckRequest(service=health_name)
                    reply = health.Check(request, timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise KvmeshError(
                        Reason.MODEL_NOT_READY,
                        f"{self.name} not ready in time; log: {self.log_path}",
                    )
                time.sleep(0.1)

    def terminate(self, timeout_s: float) -> None:
        self.stopping = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()

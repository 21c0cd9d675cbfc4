"""Hosts on one machine: a network namespace each, with its own address on a shared bridge.

The test process stays in the root namespace, on the bridge's address, and reaches every host
through it; a host's link is cut with `ip link set <its veth> down` on the root side, which
drops its packets silently (no reset), as a failed switch port or node would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

SUBNET = "10.231.77"
BRIDGE = "kvmh0"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = _ip("netns", "add", "kvmh-probe", check=False)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    _ip("netns", "del", "kvmh-probe", check=False)
    return None


@dataclass
class Host:
    name: str
    address: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return f"kvmh-{self.name}"

    @property
    def link(self) -> str:
        return f"kvmh-{self.name}"  # the root-side end of its veth pair

    def spawn(self, command: list[str], log_path: str) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def python(self, module: str, args: list[str], log_path: str) -> subprocess.Popen[bytes]:
        return self.spawn([sys.executable, "-m", module, *args], log_path)

    def redis(self, log_path: str) -> subprocess.Popen[bytes]:
        """redis-server on this host's address, port 6379."""
        redis = shutil.which("redis-server")
        assert redis, "redis-server is not installed"
        return self.spawn(
            # Not loopback: protected mode would refuse every other host without a password.
            [redis, "--bind", self.address, "--port", "6379", "--save", "", "--appendonly",
             "no", "--protected-mode", "no"],
            log_path,
        )  # fmt: skip

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self.processes.clear()


class Network:
    """A bridge in the root namespace and one namespace per host, torn down whole."""

    def __init__(self, names: list[str]) -> None:
        self.gateway_address = f"{SUBNET}.1"
        self.hosts = {name: Host(name, f"{SUBNET}.{10 + i}") for i, name in enumerate(names)}

    def __enter__(self) -> Network:
        self.teardown()  # whatever a killed run left behind
        try:
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", BRIDGE)
            _ip("link", "set", BRIDGE, "up")
            for host in self.hosts.values():
                _ip("netns", "add", host.namespace)
                _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0",
                    "netns", host.namespace)  # fmt: skip
                _ip("link", "set", host.link, "master", BRIDGE)
                _ip("link", "set", host.link, "up")
                inside = ("-n", host.namespace)
                _ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip(*inside, "link", "set", "eth0", "up")
                _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts.values():
            host.stop()
        self.teardown()

    def teardown(self) -> None:
        for host in self.hosts.values():
            _ip("netns", "del", host.namespace, check=False)
            _ip("link", "del", host.link, check=False)
        _ip("link", "del", BRIDGE, check=False)

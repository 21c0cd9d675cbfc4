"""`kvmesh up` owns its mesh: killed outright (SIGKILL: a job timeout, the OOM killer) its
services and Redis go with it; started as a background job (SIGINT ignored), Ctrl-C and
SIGTERM still drain and stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil

from shared.pb.kvmesh.v1 import inference_pb2_grpc
from tests.e2e.mesh_helpers import ids_request

GONE_WITHIN_S = 10.0  # the bound for a hard-killed launcher


def start_up(
    model_dir: str, log_dir: Path, ignore_sigint: bool = False, env: dict | None = None
) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "kvmesh", "up", "--model", model_dir, "--port", "0",
        "--http-port", "-1", "--control-port", "-1", "--threads", "1",
        "--kv-memory", "16MiB", "--log-dir", str(log_dir),
    ]  # fmt: skip

    def background_job() -> None:  # what `cmd &` in a non-interactive shell does
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=background_job if ignore_sigint else None,
        env={**os.environ, **(env or {})},
    )


def gateway_of(up: subprocess.Popen) -> str:
    """The address `kvmesh up` prints on stdout once the mesh is ready."""
    assert up.stdout is not None
    line = up.stdout.readline().strip()
    assert line.startswith("127.0.0.1:"), f"kvmesh up printed {line!r}"
    return line


def alive(processes: list[psutil.Process]) -> list[str]:
    """Those still running (a zombie waiting for its reaper has already stopped)."""
    running = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(" ".join(process.cmdline()[:4]))
        except psutil.NoSuchProcess:
            pass
    return running


def wait_all_gone(processes: list[psutil.Process]) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while still := alive(processes):
        assert time.monotonic() < deadline, f"still running: {still}"
        time.sleep(0.2)


def stream_forever(address: str, stop: threading.Event) -> None:
    """Load while the launcher dies: long streams, restarted as they end."""
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while not stop.is_set():
            try:
                for _ in stub.Generate(ids_request([1, 2, 3], max_tokens=500, ignore_eos=True)):
                    if stop.is_set():
                        break
            except grpc.RpcError:
                time.sleep(0.05)


def test_a_sigkilled_launcher_takes_its_whole_mesh_along(tiny_llama_dir: str, tmp_path) -> None:
    up = start_up(tiny_llama_dir, tmp_path)
    try:
        address = gateway_of(up)
        services = psutil.Process(up.pid).children(recursive=True)
        names = {" ".join(p.cmdline()[:3]) for p in services}
        assert any("redis-server" in n for n in names) and len(services) >= 6, names
        stop = threading.Event()
        clients = [threading.Thread(target=stream_forever, args=(address, stop)) for _ in range(4)]
        for client in clients:
            client.start()
        time.sleep(1.0)  # streams under way
        up.kill()
        up.wait()
        wait_all_gone(services)
        stop.set()
        for client in clients:
            client.join(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()


def test_a_background_launcher_stops_on_sigint_and_sigterm(tiny_llama_dir: str, tmp_path) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        env = {"KVMESH_RUN_FILE": str(tmp_path / f"{signum.name}.json")}
        up = start_up(tiny_llama_dir, tmp_path / signum.name, ignore_sigint=True, env=env)
        try:
            gateway = gateway_of(up)
            record = json.loads(Path(env["KVMESH_RUN_FILE"]).read_text())
            assert record["pid"] == up.pid and record["gateway"] == gateway
            assert record["collector"] and record["redis"].startswith("redis://")
            assert "gateway" in record["metrics"]
            # The client commands find the mesh from the record: no address given.
            summary = subprocess.run(
                [sys.executable, "-m", "kvmesh", "trace", "--summary"],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert summary.returncode == 0, summary.stderr
            services = psutil.Process(up.pid).children(recursive=True)
            os.kill(up.pid, signum)
            assert up.wait(timeout=60) == 0
            wait_all_gone(services)
            assert not Path(env["KVMESH_RUN_FILE"]).exists()
        finally:
            if up.poll() is None:
                up.kill()

"""A first `kvmesh up` on a machine with no prepared artifact answers while its worker's step
programs compile in child processes; stopped then, it leaves nothing behind: no process, no
staging folder; if the preparation fails, `kvmesh up`, the worker's metrics and its
compiled-step health say so while the eager step serves on. (The switch to the compiled
programs: test_prepared_artifact.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import MeshClient, generate_request
from services.engine_worker.compiled_step_status import COMPILED_STEP_HEALTH

STOP_WITHIN_S = 10.0


def processes_with(marker: str) -> dict[int, str]:
    """Live processes whose environment holds `marker`, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie has let go of everything; its parent reaps it
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def printed(log: Path, prefix: str) -> str | None:
    """The last word of `kvmesh up`'s first line starting with `prefix`."""
    for line in log.read_text().splitlines():
        if line.startswith(prefix):
            return line.split()[-1]
    return None


def answers(address: str) -> bool:
    """Whether the mesh streams a four-token answer."""
    request = generate_request(token_ids=[5, 9, 11, 2], max_tokens=4, temperature=0.0)
    with MeshClient(address) as client:
        events = list(client.stream(request, timeout=60))
    return sum(len(e.delta.token_ids) for e in events if e.HasField("delta")) == 4


def first_up(model: str, cache: Path, log: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """`kvmesh up` on an empty cache, once its gateway answers: the process, the gateway's
    address, and the deadline the test keeps to."""
    flags = "--quantize int4 --compile auto --prepared auto --kv-memory 64MiB"
    up = subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "up", "--model", model, *flags.split()],
        env={**os.environ, "KVMESH_CACHE_DIR": str(cache)},
        stdout=log.open("w"),  # a file: a full pipe would stall the launcher
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while (address := printed(log, "kvmesh:   gateway: ")) is None:
        if up.poll() is not None or time.monotonic() > deadline:
            up.kill()
            raise AssertionError(f"never ready: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return up, address, deadline


def test_a_first_start_answers_while_compiling_and_sigterm_leaves_nothing_behind(
    tiny_qwen2_dir: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    marker = f"KVMESH_CACHE_DIR={cache}"
    log = tmp_path / "up.log"
    up, address, deadline = first_up(tiny_qwen2_dir, cache, log)
    try:
        assert answers(address)
        # The deepest the tree gets: the worker, the child preparing, the programs compiling.
        while not any("saved_programs" in c for c in processes_with(marker).values()):
            assert time.monotonic() < deadline, "no program ever compiled"
            time.sleep(0.2)
        assert not list((cache / "prepared").glob("*/manifest.json"))  # answered before that
        assert list((cache / "prepared").glob(".*.tmp"))  # what must go
        up.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        up.wait(timeout=STOP_WITHIN_S)
        while (left := processes_with(marker)) and time.monotonic() - stopped < STOP_WITHIN_S:
            time.sleep(0.2)
        assert not left, left
        assert not list((cache / "prepared").glob(".*.tmp"))
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
        up.kill()


def test_a_failed_preparation_is_printed_and_the_eager_step_serves_on(
    tiny_qwen2_dir: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    marker = f"KVMESH_CACHE_DIR={cache}"
    log = tmp_path / "up.log"
    up, address, deadline = first_up(tiny_qwen2_dir, cache, log)
    try:
        assert "engine-worker-0 answers on its eager step" in log.read_text()
        # The child preparing the model dies (as an OOM kill would take it).
        while not (child := [p for p, c in processes_with(marker).items() if "in_child" in c]):
            assert time.monotonic() < deadline, "no child preparing"
            time.sleep(0.2)
        os.kill(child[0], signal.SIGKILL)
        failed = "kvmesh: engine-worker-0: preparing its compiled step failed ("
        while failed not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        assert f"{failed}the child preparing the model was killed by SIGKILL)" in log.read_text()
        assert "it serves on its eager step" in log.read_text()
        metrics_url = printed(log, "kvmesh:   metrics engine-worker-0: ")
        assert metrics_url is not None
        with urllib.request.urlopen(metrics_url, timeout=10) as page:
            metrics = page.read().decode()
        assert "kvmesh_step_preparation_failed 1.0" in metrics
        assert "kvmesh_step_compiled 0.0" in metrics
        assert "kvmesh_event_loop_lag_seconds_count" in metrics  # every service's, this one's
        assert compiled_step_health(log) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert answers(address)  # on the eager step
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=30)
        finally:
            for pid in processes_with(marker):
                os.kill(pid, signal.SIGKILL)
            up.kill()


def compiled_step_health(up_log: Path) -> int:
    """The worker's compiled-step health status, at the address its own log says it listens on."""
    logs = printed(up_log, "kvmesh:   logs: ")
    assert logs is not None
    lines = (Path(logs) / "engine-worker-0.log").read_text().splitlines()
    address = next(json.loads(line)["address"] for line in lines if '"msg": "listening"' in line)
    with grpc.insecure_channel(address) as channel:
        check = health_pb2.HealthCheckRequest(service=COMPILED_STEP_HEALTH)
        return health_pb2_grpc.HealthStub(channel).Check(check, timeout=10).status

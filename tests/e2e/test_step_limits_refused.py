"""A scheduler started beside its engine-worker by hand (compose, Kubernetes) with a larger
token budget than the worker's buffers were sized for refuses to start, naming both values,
instead of failing its first long step inside the worker."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvmesh.mesh.service_process import ServiceProcess, free_port
from tests.model_fixtures import save_random_checkpoint


def start(name: str, module: str, args: list[str], logs: Path) -> ServiceProcess:
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", module, "--port", address.rsplit(":", 1)[1], *args]
    return ServiceProcess.start(name, address, command, {}, str(logs / f"{name}.log"))


def test_a_scheduler_planning_past_its_workers_limits_exits_naming_both(tmp_path: Path) -> None:
    model = save_random_checkpoint(tmp_path / "model", "llama")
    worker = start(
        "engine-worker",
        "services.engine_worker",
        ["--model", model, "--kv-memory", "8MiB", "--threads", "1", "--max-batched-tokens", "256"],
        tmp_path,
    )
    scheduler = None
    try:
        worker.wait_ready(time.monotonic() + 120)
        scheduler = start(
            "scheduler",
            "services.scheduler",
            ["--worker", worker.grpc_address, "--max-batched-tokens", "1024"],
            tmp_path,
        )
        assert scheduler.process.wait(timeout=60) == 2
        log = scheduler.log_tail(50)
        assert "--max-batched-tokens 1024 is above the 256 tokens" in log
        assert worker.grpc_address in log
    finally:
        for process in (scheduler, worker):
            if process is not None:
                process.terminate(10)

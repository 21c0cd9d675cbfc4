"""`CompiledStepWatch.wait`: what benchmarks call so that they never measure a first start's
eager step while its compiled step compiles."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvmesh.mesh.compiled_steps import CompiledStepWatch
from kvmesh.mesh.service_process import ServiceProcess
from services.engine_worker.preparation_underway import COMPILED_SERVING, EAGER_WHILE_COMPILING


def _line(message: str) -> str:
    return json.dumps({"msg": message}) + "\n"


def _append(path: str, message: str) -> None:
    with open(path, "a") as log:
        log.write(_line(message))


@pytest.fixture
def worker(tmp_path):
    log = tmp_path / "engine-worker-0.log"
    log.write_text(_line("ready") + _line(EAGER_WHILE_COMPILING))
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    process = subprocess.Popen(command)
    yield ServiceProcess("engine-worker-0", None, process, str(log), command, {})
    process.kill()
    process.wait()


def test_wait_returns_once_the_compiled_step_serves(worker):
    watch = CompiledStepWatch([worker])
    assert watch.pending == [worker]
    switched = threading.Timer(1.5, _append, (worker.log_path, COMPILED_SERVING))
    switched.start()
    started = time.monotonic()
    watch.wait(timeout_s=30)
    assert time.monotonic() - started >= 1.4  # it waited for the line
    assert watch.pending == [] and watch.failed == []


def test_wait_gives_up_after_its_timeout(worker):
    with pytest.raises(TimeoutError, match="never served"):
        CompiledStepWatch([worker]).wait(timeout_s=1.5)


def test_wait_ends_when_the_compiling_worker_exits(worker):
    worker.process.kill()
    started = time.monotonic()
    CompiledStepWatch([worker]).wait(timeout_s=30)
    assert time.monotonic() - started < 2.0  # not its timeout: nothing left to wait for


def test_a_worker_that_loaded_its_compiled_step_is_not_waited_for(worker):
    Path(worker.log_path).write_text(_line("prepared model loaded"))
    started = time.monotonic()
    CompiledStepWatch([worker]).wait(timeout_s=30)
    assert time.monotonic() - started < 0.5

"""A service slow to become ready is not waited on in silence: the launcher says how long it
has waited and the service's last log message."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from kvmesh.mesh import service_process
from kvmesh.mesh.service_process import ServiceProcess, free_port
from shared.errors import KvmeshError, Reason


def test_a_slow_start_reports_its_last_log_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(service_process, "PROGRESS_EVERY_S", 0.3)
    line = json.dumps({"level": "info", "msg": "preparing the model for this machine"})
    script = f"import time; print({line!r}, flush=True); time.sleep(30)"
    slow = ServiceProcess.start(
        "engine-worker-0",
        f"127.0.0.1:{free_port()}",  # nothing listens there: never ready
        [sys.executable, "-c", script],
        {},
        str(tmp_path / "worker.log"),
    )
    try:
        with pytest.raises(KvmeshError) as refused:
            slow.wait_ready(time.monotonic() + 1.5)
    finally:
        slow.process.kill()
    assert refused.value.reason is Reason.MODEL_NOT_READY
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) >= 2
    assert notes[0].startswith("kvmesh: engine-worker-0 not ready after 0s: ")
    assert notes[-1].endswith(": preparing the model for this machine")

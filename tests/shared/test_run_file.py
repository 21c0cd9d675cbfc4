"""The run file `kvmesh up` leaves for the client commands, and what they say when nothing
answers at an address."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh import run_file
from shared.errors import KvmeshError, Reason


@pytest.fixture(autouse=True)
def own_run_file(tmp_path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    path = tmp_path / "mesh.json"
    monkeypatch.setenv("KVMESH_RUN_FILE", str(path))
    return path


def test_written_read_and_removed_by_its_own_launcher(own_run_file) -> None:  # type: ignore[no-untyped-def]
    run_file.write({"gateway": "127.0.0.1:1234", "collector": "127.0.0.1:5678"})
    assert run_file.read()["gateway"] == "127.0.0.1:1234"  # type: ignore[index]
    assert run_file.gateway(None) == run_file.gateway("up") == "127.0.0.1:1234"
    assert run_file.gateway("10.0.0.1:50051") == "10.0.0.1:50051"  # an address given wins
    assert run_file.address_of("collector", "x") == "127.0.0.1:5678"
    run_file.remove()
    assert not own_run_file.exists()


def test_a_record_whose_launcher_is_gone_is_ignored(own_run_file) -> None:  # type: ignore[no-untyped-def]
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    own_run_file.write_text(json.dumps({"pid": int(finished.stdout), "gateway": "h:1"}))
    assert run_file.read() is None
    assert run_file.gateway(None, "127.0.0.1:50051") == "127.0.0.1:50051"
    with pytest.raises(KvmeshError) as none:
        run_file.gateway("up")
    assert none.value.reason is Reason.UNREACHABLE and str(own_run_file) in none.value.message


def test_an_unreachable_collector_is_unreachable_with_its_address() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", "trace", "--summary", "--collector", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "UNREACHABLE" in result.stderr and "127.0.0.1:1" in result.stderr
    assert "MODEL_NOT_READY" not in result.stderr

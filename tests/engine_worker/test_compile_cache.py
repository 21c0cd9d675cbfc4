"""The compile cache kvmesh owns: Inductor's output under $KVMESH_CACHE_DIR, one compile for
two processes racing on a key (the second waits on the lock and loads from the cache), the
user's TORCHINDUCTOR_CACHE_DIR kept. (The compiled model's manifest: test_compiled_model.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from services.engine_worker.compile_cache import cache_root, compiling

CAPABILITY = torch.backends.cpu.get_cpu_capability().lower()  # one Inductor folder for each

# A process compiling one small function inside `compiling`, printing what it took.
COMPILE_ONE = """
import json, torch
from services.engine_worker.compile_cache import compiling
with compiling(("tiny", "function")) as use:
    torch.compile(lambda x: (x * 3 + 1).sin().sum())(torch.arange(8.0))
print(json.dumps(use.to_dict()))
"""


def compile_in_processes(count: int, env: dict[str, str]) -> list[dict]:
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", COMPILE_ONE], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes)
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def test_two_processes_on_one_key_compile_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["KVMESH_CACHE_DIR"] = str(tmp_path)
    first, second = sorted(compile_in_processes(2, env), key=lambda use: use["misses"])
    assert first["directory"] == second["directory"] == str(tmp_path / "inductor" / CAPABILITY)
    assert (second["misses"], first["misses"]) == (1, 0)  # one compiled it...
    assert first["hits"] == 1  # ...the other waited and loaded it
    assert any((tmp_path / "inductor" / CAPABILITY).rglob("*.py"))  # the compiled code is kvmesh's


def test_a_users_inductor_folder_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "kvmesh"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    with compiling(("a", "key")) as use:
        pass
    assert use.directory == str(tmp_path / "mine")
    assert (use.hits, use.misses) == (0, 0)


def test_the_cache_folder_is_kvmeshs_own(monkeypatch) -> None:
    monkeypatch.delenv("KVMESH_CACHE_DIR", raising=False)
    assert cache_root() == Path.home() / ".cache" / "kvmesh"
    monkeypatch.setenv("KVMESH_CACHE_DIR", "/srv/kvmesh-cache")
    assert cache_root() == Path("/srv/kvmesh-cache")


def test_inductors_own_default_counts_as_unset(tmp_path: Path, monkeypatch) -> None:
    """Inductor writes its /tmp default into the variable the first time it looks."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    with compiling(("a", "key")) as use:
        pass
    assert use.directory == str(tmp_path / "inductor" / CAPABILITY)

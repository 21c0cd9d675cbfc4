"""A first `kvmesh up` on a machine with no prepared artifact answers while its worker's step
programs compile in child processes; stopped then, it leaves nothing behind: no process, no
staging folder. (The switch to the compiled programs: test_prepared_artifact.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.client import MeshClient, generate_request

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


def gateway_address(log: Path) -> str | None:
    for line in log.read_text().splitlines():
        if line.startswith("kvmesh:   gateway: "):
            return line.split()[-1]
    return None


def test_a_first_start_answers_while_compiling_and_sigterm_leaves_nothing_behind(
    tiny_qwen2_dir: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    marker = f"KVMESH_CACHE_DIR={cache}"
    log = tmp_path / "up.log"  # a file: a full pipe would stall the launcher
    flags = "--quantize int4 --compile auto --prepared auto --kv-memory 64MiB"
    up = subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "up", "--model", tiny_qwen2_dir, *flags.split()],
        env={**os.environ, "KVMESH_CACHE_DIR": str(cache)},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while (address := gateway_address(log)) is None:
            assert up.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.2)
        request = generate_request(token_ids=[5, 9, 11, 2], max_tokens=4, temperature=0.0)
        with MeshClient(address) as client:
            events = list(client.stream(request, timeout=60))
        assert sum(len(e.delta.token_ids) for e in events if e.HasField("delta")) == 4
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

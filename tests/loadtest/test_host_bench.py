"""`make bench-host` rehearsed small: each way prints a row with figures (never a speed check)."""

from __future__ import annotations

import subprocess
import sys


def test_every_way_prints_its_rows() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.host_bench", "--batches", "1,4", "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
    )
    assert "Traceback" not in done.stderr  # a worker whose every step raised prints rows too
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    ways = [" ".join(row[:-7]) for row in rows]
    ways_run = ["in process", "link, lock-step", "link, ahead", "service, ahead"]
    assert ways == [way for way in ways_run for _ in range(2)]
    for row in rows:
        step_us, scheduler_us, worker_us = (float(cell) for cell in row[-6:-3])
        assert step_us > 0 and scheduler_us > 0 and worker_us > 0
        assert row[-1] == "0"  # its pool held the whole run: a steady batch

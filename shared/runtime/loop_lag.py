"""How late a service's event loop runs what is ready to run: the sign of a saturated stage.

A task asks to wake every `PERIOD_S` and records how much later than asked it woke. An idle or
healthy loop wakes within a fraction of a millisecond; a process whose loop is busy with
per-token work wakes late, and every stream it carries waits as long. Across the mesh, the
stage whose lag p99 nears the step time (2 ms on a fast GPU) is the one the others wait on.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

PERIOD_S = 0.1  # ten samples a second: a few µs of the loop's time
LOOP_LAG = Histogram(
    "kvmesh_event_loop_lag_seconds",
    "How much later than asked this process's asyncio loop woke a timer (sampled every 0.1 s): "
    "its p99 nearing the step time means this stage limits the mesh",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)


async def watch_loop_lag(period_s: float = PERIOD_S) -> None:
    """Runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        LOOP_LAG.observe(max(0.0, loop.time() - due))

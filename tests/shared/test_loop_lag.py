"""`kvmesh_event_loop_lag_seconds`: a loop held busy is seen late by the watcher, by about as
long as it was held; an idle one is not."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from shared.runtime.loop_lag import watch_loop_lag


def lag_total() -> tuple[float, float]:
    sample = REGISTRY.get_sample_value
    return (
        sample("kvmesh_event_loop_lag_seconds_sum") or 0.0,
        sample("kvmesh_event_loop_lag_seconds_count") or 0.0,
    )


async def test_a_loop_held_busy_shows_as_lag() -> None:
    watcher = asyncio.create_task(watch_loop_lag(period_s=0.01))
    try:
        await asyncio.sleep(0.05)  # a few samples of an idle loop
        before_sum, before_count = lag_total()
        time.sleep(0.2)  # the loop held: nothing else runs meanwhile
        await asyncio.sleep(0.03)
        after_sum, after_count = lag_total()
    finally:
        watcher.cancel()
    assert after_count > before_count
    assert after_sum - before_sum >= 0.15  # the 0.2 s it was held, seen by one wake-up

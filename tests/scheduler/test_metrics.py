"""The scheduler's Prometheus collector: registered on the event loop without reading the
load report (it would wait on its own loop), read at scrape time from another thread."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.scheduler.metrics import SchedulerMetrics
from shared.pb.kvmesh.v1 import scheduler_pb2


async def test_registering_on_the_loop_reads_nothing_and_a_scrape_reads_the_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reads: list[float] = []

    def read() -> scheduler_pb2.LoadReport:
        reads.append(time.monotonic())
        return scheduler_pb2.LoadReport(num_running=3, num_blocks=8, num_blocks_referenced=2)

    registry = CollectorRegistry(auto_describe=True)  # as the default REGISTRY is
    caplog.set_level(logging.WARNING, logger="kvmesh.scheduler")
    started = time.monotonic()
    registry.register(SchedulerMetrics(asyncio.get_running_loop(), read))
    assert time.monotonic() - started < 0.5  # no wait on the loop it runs on
    assert not reads and not caplog.records  # nothing read, no warning (was a traceback)

    scraped = (await asyncio.to_thread(generate_latest, registry)).decode()
    assert "kvmesh_requests_running 3.0" in scraped
    assert "kvmesh_kv_cache_usage_ratio 0.25" in scraped
    assert "kvmesh_preemptions_total 0.0" in scraped
    assert len(reads) == 1 and not caplog.records

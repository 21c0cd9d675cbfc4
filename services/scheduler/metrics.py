"""The scheduler's gauges and lifetime counters, read from its load report at scrape time.

A scrape runs on the metrics server's thread; the report is computed on the event loop (the
scheduler's queues are not thread-safe), so every value comes from one consistent moment.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.pb.kvmesh.v1 import scheduler_pb2

log = logging.getLogger("kvmesh.scheduler")
SCRAPE_TIMEOUT_S = 2.0


class SchedulerMetrics(Collector):
    def __init__(
        self, loop: asyncio.AbstractEventLoop, read: Callable[[], scheduler_pb2.LoadReport]
    ) -> None:
        self._loop = loop
        self._read = read

    def _report(self) -> scheduler_pb2.LoadReport | None:
        if self._loop.is_closed():
            return None

        async def read() -> scheduler_pb2.LoadReport:
            return self._read()

        future = asyncio.run_coroutine_threadsafe(read(), self._loop)
        try:
            return future.result(SCRAPE_TIMEOUT_S)
        except Exception:  # a scrape never takes the process down
            log.warning("metrics scrape could not read the load report", exc_info=True)
            return None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        report = self._report()
        if report is None:
            return
        gauges = {
            "kvmesh_requests_running": ("Requests in the running batch", report.num_running),
            "kvmesh_requests_waiting": ("Requests queued for a first step", report.num_waiting),
            "kvmesh_kv_blocks_free": (
                "KV blocks free (cached ones included)",
                report.num_free_blocks,
            ),
            "kvmesh_kv_blocks_used": ("KV blocks held by requests", report.num_blocks_referenced),
            "kvmesh_scheduler_open_streams": (
                "Submit streams without a terminal event yet",
                report.num_open_streams,
            ),
            "kvmesh_queue_time_estimate_seconds": (
                "Estimated wait of a request arriving now",
                report.queue_time_estimate_ms / 1e3,
            ),
            # Autoscaling signals (an HPA on custom metrics, or KEDA): prefill work queued and
            # how full the KV pool is, which is what runs out before CPU does.
            "kvmesh_waiting_tokens": (
                "Prompt tokens of queued requests: prefill work not started",
                report.num_waiting_tokens,
            ),
            "kvmesh_kv_cache_usage_ratio": (
                "Fraction of KV blocks held by requests",
                report.num_blocks_referenced / report.num_blocks if report.num_blocks else 0.0,
            ),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(name, help_text, value=value)
        counters = {
            "kvmesh_prefix_cache_hit_tokens": (
                "Prompt tokens found in the prefix cache",
                report.prefix_hit_tokens,
            ),
            "kvmesh_prefix_cache_query_tokens": (
                "Prompt tokens looked up in the prefix cache (hit ratio: hits / queries)",
                report.prefix_query_tokens,
            ),
            "kvmesh_prefix_cache_evictions": (
                "Cached KV blocks evicted to make room",
                report.prefix_evictions,
            ),
            "kvmesh_requests_failed_execution": (
                "Requests ended because the engine could not compute them",
                report.num_failed_execution,
            ),
            "kvmesh_preemptions": ("Requests preempted for KV room", report.num_preemptions),
            "kvmesh_scheduler_steps": ("Steps sent to the engine-worker", report.num_steps),
            "kvmesh_spec_draft_tokens": (
                "Speculative draft tokens proposed for verification",
                report.num_draft_tokens,
            ),
            "kvmesh_spec_accepted_draft_tokens": (
                "Speculative draft tokens accepted (acceptance rate: accepted / draft)",
                report.num_accepted_draft_tokens,
            ),
            "kvmesh_deadline_expired": (
                "Requests whose deadline passed in the scheduler",
                report.num_expired_waiting + report.num_expired_running,
            ),
        }
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(name, help_text, value=value)

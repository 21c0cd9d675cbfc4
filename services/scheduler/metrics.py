"""The scheduler's gauges and lifetime counters, read from its load report at scrape time.

A scrape runs on the metrics server's thread; the report is computed on the event loop (the
scheduler's queues are not thread-safe), so every value comes from one consistent moment.
Registration reads only `describe()`: collecting from the loop's own thread would wait on
itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.pb.kvmesh.v1 import scheduler_pb2

log = logging.getLogger("kvmesh.scheduler")
SCRAPE_TIMEOUT_S = 2.0
Read = Callable[[scheduler_pb2.LoadReport], float]

GAUGES: dict[str, tuple[str, Read]] = {
    "kvmesh_requests_running": ("Requests in the running batch", lambda r: r.num_running),
    "kvmesh_requests_waiting": ("Requests queued for a first step", lambda r: r.num_waiting),
    "kvmesh_kv_blocks_free": (
        "KV blocks free (cached ones included)",
        lambda r: r.num_free_blocks,
    ),
    "kvmesh_kv_blocks_used": ("KV blocks held by requests", lambda r: r.num_blocks_referenced),
    "kvmesh_scheduler_open_streams": (
        "Submit streams without a terminal event yet",
        lambda r: r.num_open_streams,
    ),
    "kvmesh_queue_time_estimate_seconds": (
        "Estimated wait of a request arriving now",
        lambda r: r.queue_time_estimate_ms / 1e3,
    ),
    # Autoscaling signals (an HPA on custom metrics, or KEDA): prefill work queued and how full
    # the KV pool is, which is what runs out before CPU does.
    "kvmesh_waiting_tokens": (
        "Prompt tokens of queued requests: prefill work not started",
        lambda r: r.num_waiting_tokens,
    ),
    "kvmesh_kv_cache_usage_ratio": (
        "Fraction of KV blocks held by requests",
        lambda r: r.num_blocks_referenced / r.num_blocks if r.num_blocks else 0.0,
    ),
}
COUNTERS: dict[str, tuple[str, Read]] = {
    "kvmesh_prefix_cache_hit_tokens": (
        "Prompt tokens found in the prefix cache",
        lambda r: r.prefix_hit_tokens,
    ),
    "kvmesh_prefix_cache_query_tokens": (
        "Prompt tokens looked up in the prefix cache (hit ratio: hits / queries)",
        lambda r: r.prefix_query_tokens,
    ),
    "kvmesh_prefix_cache_evictions": (
        "Cached KV blocks evicted to make room",
        lambda r: r.prefix_evictions,
    ),
    "kvmesh_requests_failed_execution": (
        "Requests ended because the engine could not compute them",
        lambda r: r.num_failed_execution,
    ),
    "kvmesh_preemptions": ("Requests preempted for KV room", lambda r: r.num_preemptions),
    "kvmesh_scheduler_steps": ("Steps sent to the engine-worker", lambda r: r.num_steps),
    "kvmesh_spec_draft_tokens": (
        "Speculative draft tokens proposed for verification",
        lambda r: r.num_draft_tokens,
    ),
    "kvmesh_spec_accepted_draft_tokens": (
        "Speculative draft tokens accepted (acceptance rate: accepted / draft)",
        lambda r: r.num_accepted_draft_tokens,
    ),
    "kvmesh_deadline_expired": (
        "Requests whose deadline passed in the scheduler",
        lambda r: r.num_expired_waiting + r.num_expired_running,
    ),
}


class SchedulerMetrics(Collector):
    def __init__(
        self, loop: asyncio.AbstractEventLoop, read: Callable[[], scheduler_pb2.LoadReport]
    ) -> None:
        self._loop = loop
        self._read = read

    def _on_own_loop(self) -> bool:
        """A collect from the loop's own thread would wait on itself."""
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs on this thread: the metrics server's
            return False

    def _report(self) -> scheduler_pb2.LoadReport | None:
        if self._loop.is_closed() or self._on_own_loop():
            return None

        async def read() -> scheduler_pb2.LoadReport:
            return self._read()

        future = asyncio.run_coroutine_threadsafe(read(), self._loop)
        try:
            return future.result(SCRAPE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:  # a loop busy for seconds: no series this time
            future.cancel()
            log.warning("metrics scrape: no load report within %.0f s", SCRAPE_TIMEOUT_S)
            return None
        except Exception:  # a scrape never takes the process down
            log.warning("metrics scrape could not read the load report", exc_info=True)
            return None

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name, (help_text, _) in GAUGES.items():
            yield GaugeMetricFamily(name, help_text)
        for name, (help_text, _) in COUNTERS.items():
            yield CounterMetricFamily(name, help_text)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        report = self._report()
        if report is None:
            return
        for name, (help_text, value) in GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=value(report))
        for name, (help_text, value) in COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=value(report))

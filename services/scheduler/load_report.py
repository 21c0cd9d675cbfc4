"""The scheduler's load as one LoadReport: for GetLoad, Prometheus and the Redis publisher."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.request import Request
from services.scheduler.step_loop import StepLoop
from shared.pb.kvmesh.v1 import scheduler_pb2


class LoadReporter:
    def __init__(self, loop: StepLoop, max_waiting: int) -> None:
        self.loop = loop
        self.max_waiting = max_waiting

    def report(self, include_recent_frees: bool = False) -> scheduler_pb2.LoadReport:
        loop, counters = self.loop, self.loop.counters
        report = scheduler_pb2.LoadReport(
            num_steps=counters.steps,
            worker_compute_ms=counters.worker_compute_ms,
            num_aborted=counters.aborted,
            num_expired_waiting=counters.expired_waiting,
            num_expired_running=counters.expired_running,
            num_failed_execution=counters.failed_execution,
            worker_ready=loop.worker_ready,
            max_waiting=self.max_waiting,
            num_open_streams=len(loop.tracked),
        )
        scheduler = loop.scheduler
        if scheduler is not None:
            load = scheduler.load()
            report.num_waiting = load.num_waiting
            report.num_waiting_tokens = load.num_waiting_tokens
            free_slots = loop.config.max_num_seqs - load.num_running
            releases = loop.queue_estimate.slot_releases_s(
                (r.num_output_tokens, r.sampling.max_tokens) for r in scheduler.running
            )
            queue_s = loop.queue_estimate.queue_time_s(load.num_waiting, free_slots, releases)
            report.queue_time_estimate_ms = queue_s * 1e3
            report.slot_releases_s.extend(releases)
            report.num_running = load.num_running
            report.num_free_blocks = load.num_free_blocks
            report.num_blocks = load.num_blocks
            report.num_blocks_referenced = load.num_blocks - load.num_free_blocks
            report.num_preemptions = load.num_preemptions
            report.prefix_hit_tokens = load.prefix_hit_tokens
            report.prefix_query_tokens = scheduler.block_manager.stats.queries
            report.prefix_evictions = scheduler.block_manager.stats.evictions
            report.num_draft_tokens = scheduler.speculator.num_draft_tokens
            report.num_accepted_draft_tokens = scheduler.speculator.num_accepted_drafts
            report.tenants.extend(tenant_loads(scheduler.waiting, scheduler.running))
        if include_recent_frees:
            report.recent_frees.extend(
                scheduler_pb2.FreedRequest(request_id=r, freed_unix_ns=t)
                for r, t in loop.recent_frees
            )
        return report


def tenant_loads(
    waiting: Sequence[Request], running: Sequence[Request]
) -> list[scheduler_pb2.TenantLoad]:
    """Each tenant's sequences, queued prompt tokens and blocks here, in name order."""
    loads: dict[str, scheduler_pb2.TenantLoad] = {}

    def of(request: Request) -> scheduler_pb2.TenantLoad:
        load = loads.get(request.tenant)
        if load is None:
            load = loads[request.tenant] = scheduler_pb2.TenantLoad(tenant=request.tenant)
        load.weight = request.tenant_weight
        return load

    for request in running:
        load = of(request)
        load.num_running += 1
        load.num_blocks += len(request.block_ids)
    for request in waiting:
        load = of(request)
        load.num_waiting += 1
        load.num_waiting_tokens += request.num_tokens - request.num_cached_on_arrival
    return [loads[name] for name in sorted(loads)]

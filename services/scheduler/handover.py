"""A scheduler's part in the prefill/decode split: leases (prefill role), pulls (decode role).

Prefill side: a prefill-only request ends with its first token, but its blocks stay held
(`Scheduler.leases`) and its Submit stream stays open; its `finished` event carries the ticket
a decode pair pulls with. The lease ends when the caller closes the stream (the decode pair has
the blocks) or after `lease_s`, counted as expired; either way the blocks go back.

Decode side: before a handed-over request queues, its worker pulls the ticket's blocks from
the prefill worker into memory (bounded by `pull_timeout_s`); the request's first step loads
them like a tier hit. A pull that stopped short is recomputed from there, or, under
`--kv-load-failure fail`, refuses the request with KV_HANDOVER_FAILED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from opentelemetry import trace
from prometheus_client import Counter, Gauge

from services.scheduler.step_loop import StepLoop
from shared.config import HandoverConfig
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import engine_worker_pb2, scheduler_pb2
from shared.runtime.telemetry import context_from_metadata

log = logging.getLogger("kvmesh.scheduler.handover")
tracer = trace.get_tracer("kvmesh.scheduler")
LEASES_HELD = Gauge("kvmesh_kv_handover_leases", "Prefilled requests whose blocks wait for a pull")
LEASES_EXPIRED = Counter(
    "kvmesh_kv_handover_leases_expired", "Leases that ended unclaimed: their blocks went back"
)


class Handover:
    def __init__(self, config: HandoverConfig, loop: StepLoop) -> None:
        self.config = config
        self.loop = loop

    def ticket(self, request_id: str) -> scheduler_pb2.HandoverTicket | None:
        """Where a prefill-only request's blocks wait, once it ended holding them."""
        scheduler = self.loop.scheduler
        if scheduler is None or (request := scheduler.leases.get(request_id)) is None:
            return None
        return scheduler_pb2.HandoverTicket(
            worker=self.config.worker_advertise,
            lease_id=request_id,
            num_blocks=request.prompt_len // scheduler.block_size,
            lease_s=self.config.lease_s,
        )

    async def hold(self, request_id: str) -> None:
        """Until the caller lets go of the stream (cancelling this) or the lease expires."""
        LEASES_HELD.inc()
        try:
            await asyncio.sleep(self.config.lease_s)
            LEASES_EXPIRED.inc()
            log.warning("handover lease expired", extra={"request_id": request_id})
        finally:
            LEASES_HELD.dec()
            if self.loop.scheduler is not None:
                self.loop.scheduler.release_lease(request_id)
                self.loop.wake()  # an idle worker forgets it with a plan of its own

    async def pull(
        self,
        request: scheduler_pb2.SubmitRequest,
        block_hashes: Sequence[int],
        metadata: Sequence[tuple[str, str | bytes]] | None,
    ) -> engine_worker_pb2.PullResult:
        """The ticket's blocks into this pair's worker; what arrived (its `kv_handover` span)."""
        ticket = request.handover
        wanted = list(block_hashes[: ticket.num_blocks])
        with tracer.start_as_current_span(
            "kv_handover",
            context=context_from_metadata(metadata),
            attributes={
                "kvmesh.request_id": request.request_id,
                "kvmesh.handover.prefill_worker": ticket.worker,
                "kvmesh.handover.decode_worker": self.loop.link.address,
                "kvmesh.handover.blocks_wanted": len(wanted),
            },
        ) as span:
            result = await self.loop.link.pull_blocks(
                ticket.worker, ticket.lease_id, wanted, self.config.pull_timeout_s
            )
            span.set_attributes(
                {
                    "kvmesh.handover.blocks": result.num_blocks,
                    "kvmesh.handover.bytes": result.bytes,
                    "kvmesh.handover.outcome": result.outcome,
                }
            )
        if result.num_blocks < len(wanted) and self.config.load_failure == "fail":
            raise KvmeshError(
                Reason.KV_HANDOVER_FAILED,
                f"{result.num_blocks} of {len(wanted)} prefilled blocks arrived from "
                f"{ticket.worker} ({result.outcome}); --kv-load-failure is fail",
            )
        return result

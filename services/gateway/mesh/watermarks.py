"""Whether a scheduler takes a request at all: the queue watermarks, and each tenant's fair
share of them.

A scheduler whose estimated queue time or queued tokens is past a watermark takes no request
of a tenant already holding its share there; it still takes one of a tenant below its share,
counting the request's n sequences: the scheduler serves that tenant ahead of the others
(fair_share.py: it takes a slot from the tenant furthest above its share), so the request
waits a step, not the queue the watermark measures. A tenant's share is its weight over the
weights of the tenants with requests there, of the batch's slots (its running and queued
sequences), of the KV pool and of the queued-token watermark. Below the watermarks nobody's
share is counted: one tenant alone may use the whole mesh.

With none taking it, a tenant that others share the schedulers with is refused RATE_LIMITED
(429), naming the share it is over; a tenant alone is refused OVERLOADED (503): the mesh is
full. Either way a RetryInfo gives the time the least loaded scheduler needs to drain back
under the watermark.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.mesh.worker_load import TenantHold, WorkerLoad
from shared.errors import KvmeshError, Reason
from shared.tenants import Tenant

MIN_RETRY_MS = 100
MAX_RETRY_MS = 60_000
_NOTHING_HELD = TenantHold()


@dataclass(frozen=True)
class TenantAsk:
    """What a request asks of a scheduler, on behalf of whom."""

    tenant: str
    weight: float = 1.0
    num_sequences: int = 1  # its n completions
    prompt_tokens: int = 0

    @classmethod
    def of(cls, tenant: Tenant, prompt_tokens: int, num_sequences: int = 1) -> TenantAsk:
        return cls(tenant.name, tenant.weight, num_sequences, prompt_tokens)


@dataclass(frozen=True)
class Watermarks:
    max_queue_ms: float = 0.0  # 0: no limit
    max_queue_tokens: int = 0

    def under(self, load: WorkerLoad) -> bool:
        if self.max_queue_ms and load.queue_ms > self.max_queue_ms:
            return False
        return not (self.max_queue_tokens and load.waiting_tokens > self.max_queue_tokens)

    def admits(self, load: WorkerLoad, ask: TenantAsk) -> bool:
        return self.under(load) or self.within_share(load, ask)

    def share(self, load: WorkerLoad, ask: TenantAsk) -> float:
        """The tenant's fair share there: 1.0 with no other tenant's requests."""
        others = sum(h.weight for name, h in load.tenants.items() if name != ask.tenant)
        return ask.weight / (ask.weight + others)

    def within_share(self, load: WorkerLoad, ask: TenantAsk) -> bool:
        share = self.share(load, ask)
        if share >= 1.0:
            return False  # alone there: the queue the watermarks bound is its own
        held = load.tenants.get(ask.tenant, _NOTHING_HELD)
        if held.sequences + ask.num_sequences > share * load.max_running:
            return False
        if load.num_blocks and held.blocks > share * load.num_blocks:
            return False
        tokens = held.waiting_tokens + ask.prompt_tokens
        return not (self.max_queue_tokens and tokens > share * self.max_queue_tokens)

    def refusal(self, loads: Sequence[WorkerLoad], ask: TenantAsk) -> KvmeshError:
        """The error for a request no scheduler takes."""
        retry_ms = int(min(MAX_RETRY_MS, max(MIN_RETRY_MS, self._drain_ms(loads))))
        shared = [load for load in loads if self.share(load, ask) < 1.0]
        if not shared:
            return KvmeshError(
                Reason.OVERLOADED,
                f"every scheduler is past the admission watermarks "
                f"(queue estimates {', '.join(f'{load.queue_ms:.0f} ms' for load in loads)})",
                retryable=True,
                retry_after_ms=retry_ms,
            )
        least = min(shared, key=lambda load: load.tenants.get(ask.tenant, _NOTHING_HELD).sequences)
        held = least.tenants.get(ask.tenant, _NOTHING_HELD)
        slots = self.share(least, ask) * least.max_running
        return KvmeshError(
            Reason.RATE_LIMITED,
            f"tenant {ask.tenant!r} is over its fair share: it holds {held.sequences} "
            f"sequence(s) on the least held scheduler (+{ask.num_sequences} asked), and while "
            f"other tenants' requests are there its share is {slots:.0f} of "
            f"{least.max_running} slots; every scheduler is past the admission watermarks",
            retryable=True,
            retry_after_ms=retry_ms,
        )

    def _drain_ms(self, loads: Sequence[WorkerLoad]) -> float:
        """How soon the least loaded scheduler is back under the watermarks."""
        waits = []
        for load in loads:
            drain_ms = 0.0
            if self.max_queue_ms and load.queue_ms > self.max_queue_ms:
                drain_ms = load.queue_ms - self.max_queue_ms
            if self.max_queue_tokens and load.waiting_tokens > self.max_queue_tokens:
                excess = load.waiting_tokens - self.max_queue_tokens
                per_token_ms = load.queue_ms / max(load.waiting_tokens, 1)
                drain_ms = max(drain_ms, excess * per_token_ms)
            waits.append(drain_ms)
        retry_ms = min(waits)
        return MAX_RETRY_MS if math.isinf(retry_ms) else retry_ms

"""One scheduler's load as the gateway reads it from Redis, and each tenant's hold there."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from services.gateway.mesh.connections import SchedulerBackend
from shared.queue_time import queue_time_s


@dataclass(frozen=True)
class TenantHold:
    """One tenant's requests on a scheduler, as it last published them."""

    weight: float = 1.0
    running: int = 0  # sequences in the batch
    waiting: int = 0  # sequences queued
    waiting_tokens: int = 0  # their prompt tokens not yet computed
    blocks: int = 0  # KV blocks its running sequences hold

    @property
    def sequences(self) -> int:
        return self.running + self.waiting


def parse_holds(text: bytes | None) -> dict[str, TenantHold]:
    """The publisher's `tenants` field: name -> [weight, running, waiting, waiting tokens,
    blocks]; empty when absent or unreadable (an older scheduler: no share is counted)."""
    if not text:
        return {}
    try:
        document = json.loads(text)
        return {
            str(name): TenantHold(float(w), int(r), int(q), int(t), int(b))
            for name, (w, r, q, t, b) in document.items()
        }
    except (ValueError, TypeError, AttributeError):
        return {}


def _with_ours(holds: dict[str, TenantHold], backend: SchedulerBackend) -> dict[str, TenantHold]:
    """The published holds, each at least the sequences this gateway has there (current,
    where the report can be a few steps old)."""
    for name, sequences in backend.tenant_sequences.items():
        held = holds.get(name) or TenantHold(backend.tenant_weights[name])
        if sequences > held.sequences:
            holds[name] = replace(held, waiting=sequences - held.running)
    return holds


@dataclass(frozen=True)
class WorkerLoad:
    """One scheduler's load as it last published it, corrected by what this gateway has sent
    it since (its report can be a few steps old)."""

    waiting: int  # queued there, plus sent from here and not yet accepted
    free_slots: int
    max_running: int
    in_flight_here: int  # this gateway's requests there: running or queued, never stale
    waiting_tokens: int  # prefill work queued there (or sent from here and not yet started)
    drain_per_s: float
    published: bool  # False: no fresh report in Redis
    shared_tier: bool = False  # its worker loads from the mesh's Redis KV tier
    slot_releases_s: tuple[float, ...] = ()  # when its running requests free their slots
    num_blocks: int = 0  # its KV pool
    tenants: dict[str, TenantHold] = field(default_factory=dict)

    @classmethod
    def parse(cls, fields: dict[bytes, bytes] | None, backend: SchedulerBackend) -> WorkerLoad:
        fields = fields or {}
        tokens = int(fields.get(b"waiting_tokens", 0))
        return cls(
            waiting=int(fields.get(b"waiting", 0)) + backend.in_transit,
            free_slots=int(fields.get(b"max_running", 0)) - int(fields.get(b"running", 0)),
            max_running=int(fields.get(b"max_running", 0)),
            in_flight_here=backend.in_flight,
            waiting_tokens=max(tokens, backend.pending_tokens),
            drain_per_s=float(fields.get(b"drain_per_s", 0.0)),
            published=bool(fields),
            shared_tier=fields.get(b"kv_shared_tier") == b"1",
            slot_releases_s=tuple(
                float(s) for s in fields.get(b"slot_releases_s", b"").split(b",") if s
            ),
            num_blocks=int(fields.get(b"blocks", 0)),
            tenants=_with_ours(parse_holds(fields.get(b"tenants")), backend),
        )

    @property
    def queue_ms(self) -> float:
        if not self.published:
            return 0.0  # unknown: left to the scheduler's own bounded queue
        # Two lower bounds of the queue beyond the free slots: the published one (complete, but
        # a few steps old) and this gateway's own (current, but blind to other gateways).
        releases = self.slot_releases_s
        published = queue_time_s(self.waiting, self.free_slots, self.drain_per_s, releases)
        here = queue_time_s(self.in_flight_here, self.max_running, self.drain_per_s, releases)
        return max(published, here) * 1e3

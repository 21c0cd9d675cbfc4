"""Tenants share a scheduler fairly within a priority, by the KV blocks they hold per unit of
weight (`SubmitRequest.tenant_weight`, from the gateway's API keys file).

- Admission: the next waiting request is the oldest of the tenant holding the least.
- Slots: when the batch is full, a waiting request of a tenant below its share takes the room
  of the newest running request of the tenant furthest above it, never one more urgent than
  itself, and only while that tenant would still hold at least as much after the move (each
  move levels the shares, so two tenants never trade a slot back and forth).
- KV room: preemption takes the newest request of the tenant holding the most.
- Prefill first: a step that admits a request of a tenant below its share runs only prefills,
  so its first token waits for the step in flight and its own prefill, not for the other
  tenants' decodes too (they lose one step each time; `--no-fair-prefill-first` turns it off).

A tenant that floods the queue waits behind the others, not in front of them; with one tenant
all of this is plain FCFS.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.request import Request


class TenantShares:
    """Blocks held per tenant, taken from the running batch at one moment."""

    def __init__(self, running: Sequence[Request]) -> None:
        self.held: dict[str, int] = {}
        for request in running:
            self.add(request)

    def add(self, request: Request) -> None:
        self.held[request.tenant] = self.held.get(request.tenant, 0) + len(request.block_ids)

    def share(self, request: Request, extra_blocks: int = 0) -> float:
        """Its tenant's blocks per unit of weight (with `extra_blocks` more)."""
        return (self.held.get(request.tenant, 0) + extra_blocks) / request.tenant_weight

    def next_waiting(self, waiting: Sequence[Request]) -> Request:
        """Among the most urgent waiting requests (`waiting` is in priority, arrival order):
        the oldest of the tenant with the smallest share (ties: the oldest)."""
        head = waiting[0]
        best, best_share = head, self.share(head)
        seen = {head.tenant}
        for request in waiting[1:]:
            if request.priority != head.priority:
                break
            if request.tenant in seen:
                continue
            seen.add(request.tenant)
            if (share := self.share(request)) < best_share:
                best, best_share = request, share
        return best

    def most_above(self, candidates: Sequence[Request]) -> Request:
        """The newest request of the tenant with the largest share."""
        return max(candidates, key=lambda r: (self.share(r), r.arrival_seq))

    def slot_for(
        self, candidate: Request, needed_blocks: int, running: Sequence[Request]
    ) -> Request | None:
        """The running request `candidate` may take the place of, or None."""
        others = [
            r for r in running if r.tenant != candidate.tenant and r.priority >= candidate.priority
        ]
        if not others:
            return None
        victim = self.most_above(others)
        if self.share(victim, -len(victim.block_ids)) >= self.share(candidate, needed_blocks):
            return victim
        return None

    def jumps(self, waiting: Sequence[Request], running: Sequence[Request], max_seqs: int) -> bool:
        """Whether the next waiting request's prefill goes before the running decodes: its
        tenant is below the share of another tenant running requests no more urgent than it,
        and the batch has room for it."""
        if not waiting or not running or len(running) >= max_seqs:
            return False
        candidate = self.next_waiting(waiting)
        others = [r for r in running if r.tenant != candidate.tenant]
        if not others or min(r.priority for r in others) < candidate.priority:
            return False
        return self.share(candidate) < self.share(self.most_above(others))

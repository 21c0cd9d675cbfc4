"""Tenants share a scheduler fairly within a priority, by their dominant share per unit of
weight (`SubmitRequest.tenant_weight`, from the gateway's API keys file): the larger of the
fraction of the batch's slots and the fraction of the KV pool their running requests hold.

Counting both is what keeps a light tenant's latency flat (Dominant Resource Fairness, Ghodsi
et al. 2011): counted by blocks alone, a tenant whose few requests have decoded long holds as
many blocks as a flooding tenant's many young ones, and its next request waits for a slot that
the flood keeps; counted by slots alone, a few long prompts could take the whole pool.

- Admission: the next waiting request is the oldest of the tenant with the smallest share.
- Slots: when the batch is full, a waiting request of a tenant below its share takes the room
  of the newest running request of the tenant furthest above it, never one more urgent than
  itself, and only while that tenant would still hold at least as much after the move (each
  move levels the shares, so two tenants never trade a slot back and forth).
- KV room: preemption takes the newest request of the tenant with the largest share.
- Queue bound: a full queue (`--max-waiting`) still takes a request of a tenant holding less
  than its share of that bound, so one tenant's flood fills it without shutting the others
  out (it then holds at most twice the bound).
- Prefill first: a step that admits a request of a tenant below its share runs only prefills,
  so its first token waits for the step in flight and its own prefill, not for the other
  tenants' decodes too (they lose one step each time; `--no-fair-prefill-first` turns it off).

A tenant that floods the queue waits behind the others, not in front of them; with one tenant
all of this is plain FCFS.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from services.scheduler.request import Request


class TenantShares:
    """Slots and blocks held per tenant, taken from the running batch at one moment."""

    def __init__(self, running: Sequence[Request], max_seqs: int, num_blocks: int) -> None:
        self.max_seqs = max_seqs
        self.num_blocks = num_blocks
        self.slots: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        for request in running:
            self.add(request)

    def add(self, request: Request) -> None:
        self.slots[request.tenant] = self.slots.get(request.tenant, 0) + 1
        self.blocks[request.tenant] = self.blocks.get(request.tenant, 0) + len(request.block_ids)

    def share(self, request: Request, extra_slots: int = 0, extra_blocks: int = 0) -> float:
        """Its tenant's dominant share per unit of weight (with `extra_slots` and
        `extra_blocks` more)."""
        slots = (self.slots.get(request.tenant, 0) + extra_slots) / self.max_seqs
        blocks = (self.blocks.get(request.tenant, 0) + extra_blocks) / self.num_blocks
        return max(slots, blocks) / request.tenant_weight

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

    def victim_among(self, unscheduled: Sequence[Request]) -> Request:
        """Among the least urgent running requests not yet scheduled this step: the newest
        of the tenant with the largest share."""
        lowest = unscheduled[-1].priority
        return self.most_above([r for r in unscheduled if r.priority == lowest])

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
        after_victim = self.share(victim, -1, -len(victim.block_ids))
        if after_victim >= self.share(candidate, 1, needed_blocks):
            return victim
        return None

    def slot_victim(
        self,
        waiting: Sequence[Request],
        running: Sequence[Request],
        free_blocks: int,
        blocks_needed: Callable[[int], int],
    ) -> Request | None:
        """A full batch (slots or blocks) gives one slot per step to a waiting tenant below
        its share: the running request that makes room, if any."""
        if not waiting:
            return None
        candidate = self.next_waiting(waiting)
        needed = blocks_needed(candidate.num_tokens)
        if len(running) < self.max_seqs and needed <= free_blocks:
            return None
        return self.slot_for(candidate, needed, running)

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


def queues_past_bound(
    tenant: str, weight: float, waiting: Sequence[Request], running: Sequence[Request], bound: int
) -> bool:
    """Whether a request of `tenant` (of `weight`) may queue although `waiting` holds `bound`
    requests: its tenant has fewer queued than its weighted share of the bound, counted
    against the tenants with requests here."""
    if len(waiting) >= 2 * bound:
        return False
    weights = {r.tenant: r.tenant_weight for r in itertools.chain(running, waiting)}
    weights[tenant] = weight
    queued = sum(1 for r in waiting if r.tenant == tenant)
    return queued < bound * weight / sum(weights.values())

"""The queue-time estimate the scheduler publishes and the gateway admits against: how long a
request arriving now waits before its first step.

It starts with the next step if a sequence slot is free after those already waiting.
Otherwise it waits for the k-th slot to free, k = its place beyond the free slots. The
scheduler knows when each running request should free its slot (its remaining tokens times
the step time), so the first releases come from that schedule; releases beyond it (the queue
is longer than the batch) come at the drain rate (finishes per second while full). A rate
alone misjudges a batch that started together: its four slots free at once, seconds away,
not one every quarter of that. Both sides use this one function, so the gateway can add the
requests it sent that the scheduler has not counted yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def queue_time_s(
    num_waiting: int,
    free_slots: int,
    drain_per_s: float,
    slot_releases_s: Sequence[float] = (),
) -> float:
    """Wait of a request that arrives behind `num_waiting` others. `slot_releases_s`: seconds
    until each running request frees its slot, soonest first (may be empty or cut short)."""
    needed = num_waiting + 1 - max(free_slots, 0)  # the slot release it waits for
    if needed <= 0:
        return 0.0
    if needed <= len(slot_releases_s):
        return slot_releases_s[needed - 1]
    known = slot_releases_s[-1] if slot_releases_s else 0.0
    beyond = needed - len(slot_releases_s)
    return known + beyond / drain_per_s if drain_per_s > 0 else math.inf

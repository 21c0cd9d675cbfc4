"""The queue-time estimate the scheduler publishes and the gateway admits against: how long a
request arriving now waits before its first step.

It starts with the next step if a sequence slot is free after those already waiting;
otherwise it waits for as many running requests to finish as are ahead of it beyond the free
slots, at the drain rate the scheduler measures (finishes per second while full). Both sides
use this one formula, so the gateway can add the requests it sent that the scheduler has not
counted yet.
"""

from __future__ import annotations

import math


def queue_time_s(num_waiting: int, free_slots: int, drain_per_s: float) -> float:
    """Wait of a request that arrives behind `num_waiting` others."""
    beyond_free_slots = num_waiting + 1 - max(free_slots, 0)
    if beyond_free_slots <= 0:
        return 0.0
    return beyond_free_slots / drain_per_s if drain_per_s > 0 else math.inf

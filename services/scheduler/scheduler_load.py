"""The scheduler's counts as a caller sees them from outside (GetLoad, metrics, Redis)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerLoad:
    """Counts a caller can check from outside: queues, blocks, lifetime totals."""

    num_waiting: int
    num_waiting_tokens: int  # prompt tokens waiting requests still have to compute (estimated)
    num_running: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_hit_tokens: int

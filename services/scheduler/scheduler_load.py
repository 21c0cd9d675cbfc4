"""The scheduler's counts as a caller sees them from outside (GetLoad, metrics, Redis)."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request


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

    @staticmethod
    def of(
        waiting: list[Request], running: list[Request], blocks: BlockManager, preemptions: int
    ) -> SchedulerLoad:
        return SchedulerLoad(
            len(waiting),
            sum(r.num_tokens - r.num_cached_on_arrival for r in waiting),
            len(running),
            blocks.num_free_blocks,
            blocks.num_blocks,
            preemptions,
            blocks.stats.hits,
        )

"""The window blocks a sliding-window model's worker holds for its sliding layers, counted.

The worker picks the block ids (services/engine_worker/window_blocks.py); the scheduler only
counts them, by the rule both share (shared/sliding_window.py), and a step whose spans would
not fit the pool is refused like one whose blocks would not: the same preemption makes room.
"""

from __future__ import annotations

from services.scheduler.request import Request
from shared.sliding_window import WindowPool, window_span


class WindowBudget:
    def __init__(self, pool: WindowPool, block_size: int) -> None:
        self.window = pool.window
        self.num_blocks = pool.num_blocks
        self.block_size = block_size
        self.num_used = 0

    def span(self, request: Request, num_new: int) -> int:
        """Window blocks the request holds while a step computes its next `num_new` tokens."""
        computed = request.num_computed_tokens
        first, stop = window_span(computed, computed + num_new, self.window, self.block_size)
        return stop - first

    def fits(self, request: Request, held: int) -> bool:
        return self.num_used - request.num_window_blocks + held <= self.num_blocks

    def hold(self, request: Request, held: int) -> None:
        """The request's span for the step just planned, kept until a plan schedules it again:
        a step that rejects drafts leaves their block on the worker until then too."""
        self.num_used += held - request.num_window_blocks
        request.num_window_blocks = held

    def release(self, request: Request) -> None:
        self.num_used -= request.num_window_blocks
        request.num_window_blocks = 0

    def check(self, holders: list[Request]) -> None:
        counted = sum(r.num_window_blocks for r in holders)
        if counted != self.num_used or self.num_used > self.num_blocks:
            raise AssertionError(
                f"window blocks: {self.num_used} counted, holders hold {counted}, "
                f"pool {self.num_blocks}"
            )

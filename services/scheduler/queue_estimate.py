"""The drain rate behind the queue-time estimate (shared/queue_time.py): requests that finish
per second while the scheduler is full (a queue, or every sequence slot taken).

Only full time counts: then each finish frees the slot the next queued request takes, so the
finish rate is the rate the queue drains at. A lightly loaded scheduler finishes few requests
because few arrive, not because it is slow, and says nothing about that rate. With no recent
full time (or too few finishes in it) the last measured rate stands, and before any
measurement a conservative prior does.
"""

from __future__ import annotations

import collections

from shared.queue_time import queue_time_s

PRIOR_DRAIN_PER_S = 1.0
WINDOW_S = 10.0
MIN_FINISHES = 3


class QueueTimeEstimator:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        # (end time, full seconds, finishes) of each interval that started full
        self._intervals: collections.deque[tuple[float, float, int]] = collections.deque()
        self._last: tuple[float, bool, int] | None = None  # (time, full, finished total)
        self.drain_per_s = PRIOR_DRAIN_PER_S

    def observe(self, now: float, full: bool, num_finished: int) -> None:
        """Called once per step-loop turn: whether it is full, and lifetime finishes."""
        if self._last is not None:
            then, was_full, finished_then = self._last
            if was_full and now > then:
                self._intervals.append((now, now - then, num_finished - finished_then))
        self._last = (now, full, num_finished)
        while self._intervals and self._intervals[0][0] < now - self.window_s:
            self._intervals.popleft()
        finished = sum(interval[2] for interval in self._intervals)
        if finished >= MIN_FINISHES:  # fewer say little (long requests finish rarely)
            full_s = sum(interval[1] for interval in self._intervals)
            self.drain_per_s = finished / full_s

    def queue_time_s(self, num_waiting: int, free_slots: int) -> float:
        return queue_time_s(num_waiting, free_slots, self.drain_per_s)

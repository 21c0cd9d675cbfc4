"""What the queue-time estimate (shared/queue_time.py) is made of: when each running request
should free its slot, and the drain rate beyond that.

Slot releases: a running request's remaining tokens (its max_tokens less what it produced,
capped by the typical output length when it is below it: most requests stop at an end token
well before max_tokens) times the step time (the step loop's turn while decoding, smoothed).

Drain rate: requests that finish per second while the scheduler is full (a queue, or every
sequence slot taken).

Only full time counts: then each finish frees the slot the next queued request takes, so the
finish rate is the rate the queue drains at. A lightly loaded scheduler finishes few requests
because few arrive, not because it is slow, and says nothing about that rate. With no recent
full time (or too few finishes in it) the last measured rate stands, and before any
measurement a conservative prior does.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from shared.queue_time import queue_time_s

PRIOR_DRAIN_PER_S = 1.0
WINDOW_S = 10.0
MIN_FINISHES = 3
SMOOTHING = 0.2  # weight of the newest step time and output length
MAX_STEP_S = 5.0  # a longer gap between turns is an idle wait, not a step
MAX_RELEASES = 64  # published per scheduler; later releases come at the drain rate


class QueueTimeEstimator:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        # (end time, full seconds, finishes) of each interval that started full, and their
        # sums: a turn every 2 ms keeps 5,000 in the window, too many to add up each turn.
        self._intervals: collections.deque[tuple[float, float, int]] = collections.deque()
        self._full_s = 0.0
        self._finished = 0
        self._last: tuple[float, bool, int] | None = None  # (time, full, finished total)
        self.drain_per_s = PRIOR_DRAIN_PER_S
        self.step_s: float | None = None  # one turn of the step loop while requests decode
        self.typical_output: float | None = None  # output tokens of finished requests
        self._last_running_turn: float | None = None

    def observe(self, now: float, full: bool, num_finished: int, running: bool = False) -> None:
        """Called once per step-loop turn: whether it is full, lifetime finishes, and whether
        requests are running (then the time since the last such turn is one step)."""
        if running and self._last_running_turn is not None:
            step = now - self._last_running_turn
            if step < MAX_STEP_S:
                self.step_s = step if self.step_s is None else _smooth(self.step_s, step)
        self._last_running_turn = now if running else None
        if self._last is not None:
            then, was_full, finished_then = self._last
            if was_full and now > then:
                interval = (now, now - then, num_finished - finished_then)
                self._intervals.append(interval)
                self._full_s += interval[1]
                self._finished += interval[2]
        self._last = (now, full, num_finished)
        while self._intervals and self._intervals[0][0] < now - self.window_s:
            _, full_s, finished = self._intervals.popleft()
            self._full_s -= full_s
            self._finished -= finished
        if not self._intervals:
            self._full_s, self._finished = 0.0, 0  # no drift from the float sums
        # Fewer finishes say little (long requests finish rarely).
        if self._finished >= MIN_FINISHES and self._full_s > 0:
            self.drain_per_s = self._finished / self._full_s

    def finished(self, output_tokens: int) -> None:
        previous = self.typical_output
        self.typical_output = (
            output_tokens if previous is None else _smooth(previous, output_tokens)
        )

    def slot_releases_s(self, running: Iterable[tuple[int, int]]) -> list[float]:
        """Seconds until each running request frees its slot, soonest first, from (output
        tokens so far, max_tokens) of each; empty before a step time is measured."""
        if self.step_s is None:
            return []
        releases = []
        for produced, max_tokens in running:
            remaining = max_tokens - produced
            if self.typical_output is not None and produced < self.typical_output:
                remaining = min(remaining, round(self.typical_output - produced))
            releases.append(max(remaining, 1) * self.step_s)
        releases.sort()
        return releases[:MAX_RELEASES]

    def queue_time_s(
        self, num_waiting: int, free_slots: int, slot_releases_s: Sequence[float] = ()
    ) -> float:
        return queue_time_s(num_waiting, free_slots, self.drain_per_s, slot_releases_s)


def _smooth(average: float, sample: float) -> float:
    return (1 - SMOOTHING) * average + SMOOTHING * sample

"""The queue-time model: slot releases first, the drain rate beyond them."""

from __future__ import annotations

import itertools
import math

import pytest

from services.scheduler.queue_estimate import QueueTimeEstimator
from shared.queue_time import queue_time_s


def test_a_free_slot_means_no_wait() -> None:
    assert queue_time_s(0, 1, 2.0, (3.0,)) == 0.0
    assert queue_time_s(2, 3, 0.0) == 0.0


def test_the_wait_is_the_release_of_the_slot_it_needs() -> None:
    # A batch of four that started together frees its slots at once, 4 s from now: a rate of
    # one finish per second would have promised the first arrival 1 s.
    releases = (4.0, 4.0, 4.1, 4.2)
    assert queue_time_s(0, 0, 1.0, releases) == 4.0
    assert queue_time_s(3, 0, 1.0, releases) == 4.2
    assert queue_time_s(5, 0, 2.0, releases) == pytest.approx(4.2 + 2 / 2.0)  # beyond: drain
    assert queue_time_s(1, 0, 2.0) == pytest.approx(1.0)  # no schedule: the rate alone
    assert math.isinf(queue_time_s(1, 0, 0.0))


def test_releases_come_from_remaining_tokens_times_the_step_time() -> None:
    estimator = QueueTimeEstimator()
    assert estimator.slot_releases_s([(0, 10)]) == []  # no step measured yet
    for turn in range(6):  # 50 ms per turn while requests run
        estimator.observe(turn * 0.05, False, 0, running=True)
    assert estimator.step_s == pytest.approx(0.05)
    releases = estimator.slot_releases_s([(30, 32), (0, 32), (31, 32)])
    assert releases == pytest.approx([0.05, 0.10, 1.60])
    # Requests that usually end at an end token long before max_tokens: the typical length
    # caps the remaining tokens of one still below it.
    for _ in range(20):
        estimator.finished(20)
    assert estimator.slot_releases_s([(5, 1000)]) == pytest.approx([15 * 0.05], rel=0.05)
    assert estimator.slot_releases_s([(40, 1000)]) == pytest.approx([960 * 0.05])


def test_an_idle_gap_is_not_a_step() -> None:
    estimator = QueueTimeEstimator()
    estimator.observe(0.0, False, 0, running=True)
    estimator.observe(0.1, False, 0, running=True)
    estimator.observe(0.2, False, 0, running=False)
    estimator.observe(60.0, False, 0, running=True)  # a minute idle, then work again
    estimator.observe(60.1, False, 0, running=True)
    assert estimator.step_s == pytest.approx(0.1)


def test_the_drain_rate_is_the_windows_finishes_over_its_full_seconds_at_any_length() -> None:
    # Turns every 2 ms for 30 s, full except for a spell, a finish every 7th turn: the window
    # (10 s, 5,000 turns) is kept as running sums; they must equal the sums recounted.
    estimator = QueueTimeEstimator(window_s=10.0)
    turns: list[tuple[float, bool, int]] = []
    finished = 0
    for turn in range(15_000):
        now = turn * 0.002
        full = not 12.0 <= now < 14.0
        finished += turn % 7 == 0
        estimator.observe(now, full, finished)
        turns.append((now, full, finished))
    window = [
        (later[0] - earlier[0], later[2] - earlier[2])
        for earlier, later in itertools.pairwise(turns)
        if earlier[1] and later[0] >= turns[-1][0] - 10.0
    ]
    expected = sum(f for _, f in window) / sum(s for s, _ in window)
    assert estimator.drain_per_s == pytest.approx(expected, rel=1e-6)
    assert 60 < expected < 80  # a finish per 14 ms

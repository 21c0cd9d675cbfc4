"""Workload files become the same requests for a seed, with the lengths, prefixes, cancels and
deadlines they describe; arrival times are a seeded Poisson process."""

from __future__ import annotations

import itertools
import statistics

import pytest

from loadtest.driver import LoadShape, arrival_times
from loadtest.workload import WORKLOAD_DIR, Workload


@pytest.mark.parametrize("path", sorted(WORKLOAD_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_workload_builds_the_same_requests_twice(path) -> None:
    workload = Workload.load(str(path))
    first, second = workload.build(49152, 40), workload.build(49152, 40)
    assert first == second and len(first) == 40
    for spec in first:
        assert spec.prompt and spec.max_tokens >= 1
        assert all(100 <= t < 49152 for t in spec.prompt)


def test_sharegpt_lengths_are_long_tailed_and_bounded() -> None:
    specs = Workload.load("sharegpt").build(49152, 400)
    prompts = [len(s.prompt) for s in specs]
    outputs = [s.max_tokens for s in specs]
    assert min(prompts) >= 4 and max(prompts) <= 1024
    assert 120 < statistics.median(prompts) < 260  # median 180
    assert statistics.mean(prompts) > statistics.median(prompts)  # a right tail
    assert 80 < statistics.median(outputs) < 170 and max(outputs) <= 512


def test_grid_prefixes_faults_and_context_cap() -> None:
    grid = Workload.load("fixed").build(1000, 4)
    assert [(len(s.prompt), s.max_tokens) for s in grid] == [
        (128, 64),
        (512, 128),
        (128, 64),
        (512, 128),
    ]
    shared = Workload.load("shared_prefix").build(1000, 8)
    assert shared[0].prompt[:512] == shared[4].prompt[:512] != shared[1].prompt[:512]
    faults = Workload.load("mixed_faults").build(49152, 400)
    cancels = [s for s in faults if s.cancel_after_tokens is not None]
    deadlines = [s for s in faults if s.deadline_ms]
    assert 20 < len(cancels) < 60 and 20 < len(deadlines) < 60
    assert all(1 <= s.cancel_after_tokens < max(2, s.max_tokens) for s in cancels)
    capped = Workload.load("long_context").build(49152, 4, max_context=1024)
    assert all(len(s.prompt) + s.max_tokens <= 1024 for s in capped)


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = arrival_times(4000, rate=5.0, seed=3)
    assert times == arrival_times(4000, rate=5.0, seed=3) and times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ValueError):
        LoadShape(rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="no workload"):
        Workload.load("nonexistent")

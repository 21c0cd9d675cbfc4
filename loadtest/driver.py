"""Sending a workload: open loop (Poisson arrivals at a rate) or closed loop (a concurrency),
bounded in requests and time, with a progress line on stderr.

Open loop is what a public service sees: arrivals do not wait for answers, so overload shows
as growing queues and refusals. Closed loop keeps N requests in flight: the throughput a
concurrency buys. Arrival times come from the seed, so two targets get the same schedule.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from loadtest.targets import RequestRecord
from loadtest.workload import RequestSpec


class Target(Protocol):
    async def send(self, spec: RequestSpec) -> RequestRecord: ...


@dataclass(frozen=True)
class LoadShape:
    rate: float | None = None  # requests per second, Poisson arrivals (open loop)
    concurrency: int | None = None  # requests in flight (closed loop)
    duration_s: float | None = None  # no new request after this
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of a rate (open loop) or a concurrency (closed)")

    @property
    def label(self) -> str:
        return (
            f"rate {self.rate:g}/s" if self.rate is not None else f"concurrency {self.concurrency}"
        )


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start: exponential gaps of mean 1/rate (a Poisson process)."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


class Progress:
    """`[#####.....] 45/100 done, 8 in flight, 12.3 s` on stderr, rewritten in place."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled and sys.stderr.isatty()
        self.done = self.in_flight = 0
        self.started = time.perf_counter()

    def update(self, done: int = 0, started: int = 0) -> None:
        self.done += done
        self.in_flight += started - done
        if self.enabled:
            filled = round(20 * self.done / max(1, self.total))
            sys.stderr.write(
                f"\r{self.label}: [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} "
                f"done, {self.in_flight} in flight, {time.perf_counter() - self.started:.1f} s "
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # from the first send to the last answer
    shape: LoadShape


async def run_load(
    target: Target, specs: Sequence[RequestSpec], shape: LoadShape, progress: bool = True
) -> RunResult:
    bar = Progress(len(specs), shape.label, progress)
    started = time.perf_counter()
    deadline = None if shape.duration_s is None else started + shape.duration_s

    async def one(spec: RequestSpec) -> RequestRecord:
        bar.update(started=1)
        sent_at = time.perf_counter() - started
        record = await target.send(spec)
        record.sent_at = sent_at
        bar.update(done=1)
        return record

    if shape.rate is not None:
        tasks = []
        for spec, at in zip(specs, arrival_times(len(specs), shape.rate, shape.seed), strict=True):
            if deadline is not None and started + at > deadline:
                break
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(spec)))
        records = list(await asyncio.gather(*tasks))
    else:
        queue = list(reversed(specs))
        records = []

        async def worker() -> None:
            while queue and (deadline is None or time.perf_counter() < deadline):
                records.append(await one(queue.pop()))

        assert shape.concurrency is not None
        await asyncio.gather(*(worker() for _ in range(shape.concurrency)))
    bar.close()
    records.sort(key=lambda r: r.index)
    return RunResult(records, time.perf_counter() - started, shape)

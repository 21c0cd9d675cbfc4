from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Callable
from typing import Any

from services.scheduler.scheduler import Scheduler
from services.scheduler.tier_loads import NO_TIERS, TierPolicy
from shared.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from shared.outputs import RequestOutput
from shared.step import FailedRequest, StepPlan, StepResult
from tests.scheduler.fake_worker import FakeWorker


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    chunk: int | None = 8,
    prefix_caching: bool = True,
    max_seqs: int = 16,
    max_model_len: int = 4096,
    fair_prefill_first: bool = True,
    speculative: str = "off",
    tiers: TierPolicy = NO_TIERS,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            prefill_chunk_size=chunk,
            fair_prefill_first=fair_prefill_first,
            speculative=SpeculativeConfig(speculative, max_draft_tokens=4, ngram_min=1),
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=(),
        tiers=tiers,
    )


def run_to_completion(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 10_000
) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        plan = scheduler.schedule()
        for output in scheduler.update(plan, worker.execute(plan)):
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("requests did not finish")


def step(scheduler: Scheduler, worker: FakeWorker) -> list[RequestOutput]:
    plan = scheduler.schedule()
    return scheduler.update(plan, worker.execute(plan))


def fail_one(result: StepResult, rng: random.Random) -> StepResult:
    """The result with one sampled request's computation raised instead (it alone fails)."""
    failing = rng.choice(result.sampled).request_id
    sampled = tuple(t for t in result.sampled if t.request_id != failing)
    failure = FailedRequest(failing, "EXECUTION_FAILED", "ValueError")
    return dataclasses.replace(result, sampled=sampled, failed=(failure,))


class Pipeline:
    """The step loop's order of things, without the network: a plan runs on the worker when
    sent; its result is read at once (lock-step) or after the next plan is sent (ahead)."""

    def __init__(self, scheduler: Scheduler, worker: Any, ahead: bool) -> None:
        self.scheduler, self.worker, self.ahead = scheduler, worker, ahead
        self.sent: collections.deque[tuple[StepPlan, StepResult]] = collections.deque()

    def step(self, change: Callable[[StepResult], StepResult] = lambda r: r) -> list:
        plan = self.scheduler.schedule()
        assert plan.num_scheduled_tokens <= self.scheduler.config.max_num_batched_tokens
        if self.ahead:
            self.scheduler.assume(plan)
        self.sent.append((plan, change(self.worker.execute(plan))))
        if self.ahead and len(self.sent) < 2:
            return []
        return self.scheduler.update(*self.sent.popleft())

    def drain(self) -> list:
        outputs = []
        while self.sent:
            outputs += self.scheduler.update(*self.sent.popleft())
        return outputs

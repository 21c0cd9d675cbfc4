from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.outputs import RequestOutput
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
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            prefill_chunk_size=chunk,
            fair_prefill_first=fair_prefill_first,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=(),
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

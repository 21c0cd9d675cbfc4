"""A sliding-window model's window blocks: the scheduler's count against the worker's own
allocator (services/engine_worker/window_blocks.py) over a seeded random workload, planned in
lock-step and one step ahead, with drafts, failures, aborts and preemption; and what an 8k-token
conversation holds."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest

from services.engine_worker.window_blocks import WindowBlocks
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from shared.sampling import SamplingParams
from shared.sliding_window import WindowPool, most_window_blocks
from shared.step import StepPlan, StepResult
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import Pipeline, fail_one

BLOCK = 4
WINDOW = 10


@dataclass
class _Held:
    """What WindowBlocks reads of a request: the worker's computed count, its window ids."""

    num_computed_tokens: int = 0
    window_ids: list[int] = field(default_factory=list)


class WindowedWorker(FakeWorker):
    """The fake worker, holding window blocks as the real one does, before each step."""

    def __init__(
        self, pool_blocks: int, scheduler: Scheduler, window: int = WINDOW, block: int = BLOCK
    ) -> None:
        super().__init__(block, vocab=20)
        self.window = WindowBlocks(pool_blocks + 1, window, block)  # and the null block
        self.scheduler = scheduler
        self.held: dict[str, _Held] = {}
        self.most_held = 0

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            if (held := self.held.pop(request_id, None)) is not None:
                self.window.release(held)  # type: ignore[arg-type]
        scheduled = []
        for new in plan.new_requests:
            if (old := self.held.pop(new.request_id, None)) is not None:
                self.window.release(old)  # type: ignore[arg-type]
            held = self.held[new.request_id] = _Held(new.num_computed_tokens)
            scheduled.append((held, new.num_scheduled_tokens))
        for running in plan.running_requests:
            held = self.held[running.request_id]
            held.num_computed_tokens = self.states[running.request_id].num_computed
            scheduled.append((held, running.num_scheduled_tokens))
        self.window.cover(scheduled)  # type: ignore[arg-type]
        held = self.window.num_blocks - 1 - self.window.num_free
        counted = self.scheduler.block_manager.window
        assert counted is not None and held <= counted.num_used <= counted.num_blocks
        self.most_held = max(self.most_held, held)
        return super().execute(plan)


def windowed_scheduler(pool_blocks: int, speculative: str = "off") -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=24,
            max_num_seqs=8,
            prefill_chunk_size=8,
            speculative=SpeculativeConfig(speculative, max_draft_tokens=4, ngram_min=1),
        ),
        CacheConfig(block_size=BLOCK),
        num_blocks=64,
        max_model_len=4096,
        eos_token_ids=(),
        window=WindowPool(WINDOW, pool_blocks),
    )


@pytest.mark.parametrize(
    "ahead, speculative",
    [(False, "off"), (True, "off"), (False, "ngram")],  # a plan with drafts is never ahead
    ids=["lock-step", "ahead", "drafts"],
)
def test_the_count_bounds_what_the_worker_holds(ahead: bool, speculative: str) -> None:
    """A pool too small for every request's span at once: the scheduler preempts to stay
    within it, and the worker's allocator (which raises past its pool) never runs out."""
    rng = random.Random(7)
    pool = 2 * most_window_blocks(WINDOW, 24, BLOCK)
    scheduler = windowed_scheduler(pool, speculative)
    worker = WindowedWorker(pool, scheduler)
    pipeline = Pipeline(scheduler, worker, ahead)
    finished = 0
    for step in range(3000):
        if rng.random() < 0.3 and len(scheduler.requests) < 16:
            prompt = [rng.randrange(20) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 60), temperature=0.0)
            n = rng.choice((1, 1, 2))
            for index in range(n):
                scheduler.add_request(
                    f"r{step}/{index}",
                    prompt,
                    dataclasses.replace(params, seed=index),
                    group_id=f"g{step}" if n > 1 else "",
                )
        if rng.random() < 0.03 and scheduler.requests:
            scheduler.abort(rng.choice(sorted(scheduler.requests)))
        outputs = pipeline.step(
            lambda r: fail_one(r, rng) if r.sampled and rng.random() < 0.02 else r
        )
        finished += sum(o.finished for o in outputs)
        live = list(scheduler.requests.values())
        scheduler.block_manager.check_invariants(live)
    assert finished > 300 and scheduler.num_preemptions > 0
    assert worker.most_held > pool // 2  # the pool was used, not merely reserved
    assert scheduler.block_manager.stats.forked == 0  # siblings computed their own prompts
    pipeline.drain()
    for request_id in list(scheduler.requests):
        scheduler.abort(request_id)
    scheduler.block_manager.check_invariants([])
    assert scheduler.block_manager.window is not None
    assert scheduler.block_manager.window.num_used == 0


def test_an_8k_conversation_holds_its_window_and_a_block() -> None:
    """Turn after turn, each prompt the whole conversation so far: the full layers hold the
    context, the sliding layers the window and a block (the window a multiple of the block)."""
    window, block = 512, 16
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=4, prefill_chunk_size=512),
        CacheConfig(block_size=block),
        num_blocks=1024,
        max_model_len=16384,
        eos_token_ids=(),
        window=WindowPool(window, 256),
    )
    worker = WindowedWorker(256, scheduler, window, block)
    conversation: list[int] = []
    turn = 0
    while len(conversation) < 8192:
        conversation += [turn % 20] * 700  # the user's message, then the model's answer
        request_id = f"turn{turn}"
        scheduler.add_request(request_id, conversation, SamplingParams(max_tokens=64))
        counted: list[int] = []  # window blocks while it decodes: counted,
        held: list[int] = []  # and held by the worker
        while request_id in scheduler.requests:
            plan = scheduler.schedule()
            request = scheduler.requests[request_id]
            assert request.num_window_blocks <= most_window_blocks(window, 512, block)
            result = worker.execute(plan)
            if request.num_computed_tokens > request.prompt_len:
                counted.append(request.num_window_blocks)
                held.append(len([b for b in worker.held[request_id].window_ids if b]))
                full_blocks = len(request.block_ids)
            conversation += [t for o in scheduler.update(plan, result) for t in o.new_token_ids]
        assert max(held) * block <= window + block and max(counted) == max(held)
        turn += 1
    assert turn >= 10 and scheduler.block_manager.stats.hits == 0  # no prefix to reuse
    # Gemma 3 1B's layers: 4 full, 22 sliding. Its last turn's K/V, against every layer
    # keeping the whole 8k context: 21%.
    with_windows = 4 * full_blocks + 22 * held[-1]
    assert with_windows / (26 * full_blocks) < 0.22, (full_blocks, held[-1])

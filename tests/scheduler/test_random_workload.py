"""A seeded random run of submits (some with n > 1), aborts, failures and finishes: no block
leaks or double frees, and every position a request reads holds its own token; planned in
lock-step and one step ahead (the step loop's StepPipeline: step N+1 is planned and sent to the
worker before step N's result is read)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.scheduler.request import RequestStatus
from services.scheduler.tier_loads import NO_TIERS, TierPolicy
from shared.block_hash import hash_full_blocks
from shared.outputs import RequestOutput
from shared.sampling import SamplingParams
from shared.step import StepResult
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import Pipeline, fail_one, make_scheduler

STEPS = 10_000
STOP = 19


class Emitted:
    """What each request streamed: never past a stop token, max_tokens or an abort."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.closed: set[str] = set()  # finished, failed or aborted: nothing may follow

    def add(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            assert output.request_id not in self.closed, f"{output.request_id} after its end"
            tokens = self.tokens.setdefault(output.request_id, [])
            tokens += output.new_token_ids
            assert STOP not in tokens[:-1], f"{output.request_id} went on past its stop token"
            assert len(tokens) <= self.max_tokens[output.request_id]
            if output.finished:
                self.closed.add(output.request_id)


@pytest.mark.parametrize("ahead", [False, True], ids=["lock-step", "ahead"])
@pytest.mark.parametrize("tier_write", [None, "through", "back"])
def test_random_workload_never_leaks_or_double_frees_blocks(
    tier_write: str | None, ahead: bool
) -> None:
    """With a KV tier, new requests load blocks another one wrote, and some loads fall short
    (blocks dropped from the tier between lookup and load): those are recomputed."""
    rng = random.Random(1234)
    tiers = TierPolicy(("host",), tier_write, load_min_tokens=4) if tier_write else NO_TIERS
    scheduler = make_scheduler(
        num_blocks=32, block_size=4, budget=24, chunk=8, max_seqs=8, tiers=tiers
    )
    worker = FakeWorker(4, vocab=20, tiers=tier_write is not None)
    pipeline = Pipeline(scheduler, worker, ahead)
    emitted = Emitted()
    prefixes = [[rng.randrange(20) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    next_id = 0
    finished = 0
    aborted = 0
    failed = 0
    for _ in range(STEPS):
        if rng.random() < 0.3 and len(scheduler.requests) < 24:
            prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [
                rng.randrange(20) for _ in range(rng.randint(0, 12))
            ]
            if not prompt:
                prompt = [1]
            params = SamplingParams(
                max_tokens=rng.randint(1, 40), stop_token_ids=(STOP,), temperature=0.0
            )
            tenant = rng.choice("abc")
            priority = rng.randint(0, 2)
            n = rng.choice((1, 1, 1, 2, 4))  # n > 1: completions forking from one prompt
            tier_blocks = worker.leading(hash_full_blocks(prompt, 4))
            for index in range(n):
                emitted.max_tokens[f"r{next_id}/{index}"] = params.max_tokens + index
                scheduler.add_request(
                    f"r{next_id}/{index}",
                    prompt,
                    dataclasses.replace(params, max_tokens=params.max_tokens + index),
                    priority=priority,
                    tenant=tenant,
                    tenant_weight={"a": 1.0, "b": 2.0, "c": 0.5}[tenant],
                    group_id=f"g{next_id}" if n > 1 else "",
                    num_tier_blocks=tier_blocks,
                )
            next_id += 1
        if rng.random() < 0.05 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort(victim)
            emitted.closed.add(victim)
            aborted += 1
        if worker.tier and rng.random() < 0.1:  # a tier evicts (or loses) a block
            del worker.tier[rng.choice(sorted(worker.tier))]
        if worker.tier and rng.random() < 0.03:  # or restarts empty
            worker.tier.clear()

        def one_fails(result: StepResult) -> StepResult:
            nonlocal failed
            if result.sampled and rng.random() < 0.03:  # one request's computation raised
                failed += 1
                return fail_one(result, rng)
            return result

        outputs = pipeline.step(one_fails)
        emitted.add(outputs)
        finished += sum(output.finished for output in outputs)
        live = list(scheduler.requests.values())
        scheduler.block_manager.check_invariants(live)
        holders = [r for r in live if r.block_ids]
        assert all(r.status is RequestStatus.RUNNING for r in holders)
        assert len(scheduler.running) <= 8
    assert finished > 500 and aborted > 50 and failed > 50 and scheduler.num_preemptions > 0
    stats = scheduler.block_manager.stats
    assert stats.hits > 0 and stats.evictions > 0 and stats.forked > 0
    loads = scheduler.tier_loads.stats
    if tier_write is not None:
        assert loads.loaded_tokens > 100 and loads.short_loads > 10, loads
    emitted.add(pipeline.drain())
    for request_id in list(scheduler.requests):
        scheduler.abort(request_id)
    scheduler.block_manager.check_invariants([])
    assert scheduler.block_manager.num_free_blocks == 32

"""Planning one step ahead changes when the scheduler plans, never what a request produces:
the same tokens and logprobs as lock-step, for a model-less worker under preemption, forks and
KV-tier loads, and for the real worker on a real model with greedy and seeded sampling."""

from __future__ import annotations

import random

import pytest

from services.engine_worker.step_failures import FaultInjector, FaultRule
from services.engine_worker.worker import Worker
from services.scheduler.scheduler import Scheduler
from services.scheduler.tier_loads import TierPolicy
from shared.block_hash import hash_full_blocks
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.outputs import RequestOutput
from shared.sampling import SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import Pipeline, make_scheduler


def _run(pipeline: Pipeline, arrivals: dict[int, list[tuple]], max_steps: int = 5_000) -> dict:
    """Each arrival (request id, prompt, params, group) joins before the step of its index;
    returns every request's streamed (tokens, logprobs, finish reason)."""
    streamed: dict[str, tuple[list[int], list, list]] = {}
    scheduler = pipeline.scheduler
    for step in range(max_steps):
        for request_id, prompt, params, group in arrivals.get(step, []):
            tiers = getattr(pipeline.worker, "leading", lambda hashes: 0)
            held = tiers(hash_full_blocks(prompt, scheduler.block_size))
            scheduler.add_request(request_id, prompt, params, group_id=group, num_tier_blocks=held)
        outputs: list[RequestOutput] = pipeline.step()
        if step > max(arrivals) and not scheduler.has_unfinished():
            outputs += pipeline.drain()
        for output in outputs:
            tokens, logprobs, reasons = streamed.setdefault(output.request_id, ([], [], []))
            tokens += output.new_token_ids
            logprobs += output.logprobs
            reasons += [output.finish_reason] if output.finish_reason is not None else []
        if step > max(arrivals) and not scheduler.has_unfinished() and not pipeline.sent:
            return streamed
    raise AssertionError("requests did not finish")


def _arrivals(rng: random.Random, count: int, params_of) -> dict[int, list[tuple]]:  # type: ignore[no-untyped-def]
    prefixes = [[rng.randrange(1, 20) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    arrivals: dict[int, list[tuple]] = {}
    for index in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 20) for _ in range(rng.randint(1, 9))]
        n = rng.choice((1, 1, 2))
        for member in range(n):
            request = (f"r{index}/{member}", prompt, params_of(rng), f"g{index}" if n > 1 else "")
            arrivals.setdefault(rng.randrange(60), []).append(request)
    return arrivals


def test_a_model_less_worker_streams_the_same_tokens_either_way() -> None:
    def params_of(rng: random.Random) -> SamplingParams:
        return SamplingParams(max_tokens=rng.randint(1, 30), stop_token_ids=(7,))

    runs = {}
    for ahead in (False, True):
        tiers = TierPolicy(("host",), "through", load_min_tokens=4)
        scheduler = make_scheduler(num_blocks=24, block_size=4, budget=16, max_seqs=6, tiers=tiers)
        worker = FakeWorker(4, vocab=20, tiers=True)
        runs[ahead] = _run(
            Pipeline(scheduler, worker, ahead), _arrivals(random.Random(7), 40, params_of)
        )
        assert scheduler.num_preemptions > 0 and scheduler.block_manager.stats.forked > 0
        assert scheduler.tier_loads.stats.loaded_tokens > 0
        scheduler.block_manager.check_invariants([])
        assert scheduler.block_manager.num_free_blocks == 24
    assert runs[True] == runs[False] and len(runs[True]) > 40


@pytest.fixture(scope="module")
def worker(tiny_llama_dir: str) -> Worker:
    return Worker(EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_memory_bytes=4 << 20)))


def test_the_real_worker_samples_the_same_tokens_and_logprobs_either_way(worker: Worker) -> None:
    def params_of(rng: random.Random) -> SamplingParams:
        if rng.random() < 0.5:
            return SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, logprobs=2)
        seed = rng.randrange(1 << 30)
        return SamplingParams(
            max_tokens=rng.randint(1, 24), temperature=0.9, top_p=0.9, seed=seed, logprobs=1
        )

    runs = {}
    for ahead in (False, True):
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6)
        cache = CacheConfig(block_size=worker.kv_shape.block_size)
        # A pool smaller than the worker's: preemptions happen, block ids stay valid there.
        scheduler = Scheduler(config, cache, 12, worker.max_model_len, (2,))
        arrivals = _arrivals(random.Random(11), 16, params_of)
        runs[ahead] = _run(Pipeline(scheduler, worker, ahead), arrivals)
        worker.execute(scheduler.schedule())  # the worker forgets the last ones
        assert not worker.requests and scheduler.block_manager.num_free_blocks == 12
        assert scheduler.num_preemptions > 0
    # Same tokens and finish reasons; logprobs to float32 rounding: the eager step's matmuls
    # round by batch size, and planning ahead batches a step with one more (or one fewer) row.
    assert runs[True].keys() == runs[False].keys()
    for request_id, (tokens, logprobs, reasons) in runs[True].items():
        lock_tokens, lock_logprobs, lock_reasons = runs[False][request_id]
        assert (tokens, reasons) == (lock_tokens, lock_reasons) and reasons, request_id
        for mine, theirs in zip(logprobs, lock_logprobs, strict=True):
            assert mine.token_id == theirs.token_id
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
            expected = [theirs.logprob, *(lp for _, lp in theirs.top)]
            assert [mine.logprob, *(lp for _, lp in mine.top)] == pytest.approx(expected, abs=1e-4)


def test_a_request_that_fails_while_planned_ahead_ends_alone(worker: Worker) -> None:
    """Step N fails it; step N+1, already planned, has its row: the worker skips that row (it
    reported the failure) and the rest of the batch goes on; nothing is held at the end."""
    poison = 13
    worker.faults = FaultInjector((FaultRule(poison, after_tokens=3),))
    try:
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6)
        scheduler = Scheduler(
            config, CacheConfig(block_size=worker.kv_shape.block_size), 12, 512, (2,)
        )
        pipeline = Pipeline(scheduler, worker, ahead=True)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for index, prompt in enumerate(([5, 6, 7], [5, poison, 7], [8, 9])):
            scheduler.add_request(f"r{index}", prompt, params)
        outputs: list[RequestOutput] = []
        while scheduler.has_unfinished() or pipeline.sent:
            outputs += pipeline.step() if scheduler.has_unfinished() else pipeline.drain()
        worker.execute(scheduler.schedule())  # the worker forgets the last ones
    finally:
        worker.faults = None
    tokens = {o.request_id: 0 for o in outputs}
    for output in outputs:
        tokens[output.request_id] += len(output.new_token_ids)
    failed = [o for o in outputs if o.failure is not None]
    assert [o.request_id for o in failed] == ["r1"] and tokens["r1"] == 3
    assert tokens["r0"] == tokens["r2"] == 8
    assert not worker.requests and not worker.requests.failed
    assert scheduler.block_manager.num_free_blocks == 12

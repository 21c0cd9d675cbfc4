"""The worker's persistent block tables against a batch rebuilt from scratch: a real scheduler
plans a seeded random workload (admits, finishes, aborts, preemptions, n > 1 forks, drafts,
failed requests, KV-tier writes and loads) for a real worker whose model is replaced by one that
checks, every step, that the rows built from the tables equal the rows built from each
request's block list, then samples a token that depends on the request's history."""

from __future__ import annotations

import hashlib
import random
from dataclasses import fields

import numpy
import pytest
import torch

from services.engine_worker.persistent_batch import BlockTables, HeldRequests
from services.engine_worker.step_inputs import RequestState, flatten, unique_states
from services.engine_worker.worker import Worker
from services.scheduler.tier_loads import TierPolicy
from shared.block_hash import hash_full_blocks
from shared.config import CacheConfig, EngineConfig, KVTierConfig
from shared.sampling import SamplingParams
from shared.step import FailedRequest, SampledToken
from tests.scheduler.helpers import make_scheduler

BLOCK = 4
VOCAB = 20


class CheckingRunner:
    """The real runner's pool, no model: compares both ways of building the step's rows."""

    def __init__(self, runner, rng: random.Random) -> None:  # type: ignore[no-untyped-def]
        self.runner = runner
        self.rng = rng
        self.checked_rows = 0
        self.verified_drafts = 0

    @property
    def kv_pool(self):  # type: ignore[no-untyped-def]
        return self.runner.kv_pool

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        self.runner.copy_blocks(pairs)

    def take_prompt_scores(self):  # type: ignore[no-untyped-def]
        return self.runner.take_prompt_scores()

    def step(self, scheduled: list[tuple[RequestState, int]], rng: torch.Generator):  # type: ignore[no-untyped-def]
        tables = self.runner.block_tables
        persistent = flatten(scheduled, BLOCK, tables.table)
        rebuilt = flatten(scheduled, BLOCK, None)
        for field in fields(persistent):
            mine, theirs = getattr(persistent, field.name), getattr(rebuilt, field.name)
            if isinstance(mine, numpy.ndarray):
                assert numpy.array_equal(mine, theirs), field.name
            else:
                assert mine == theirs, field.name
        self.checked_rows += persistent.decode_table.shape[0]
        states = unique_states(persistent.sampling_states)
        outcomes: list[SampledToken | FailedRequest] = []
        for state in states:
            if self.rng.random() < 0.01:
                outcomes.append(FailedRequest(state.request_id, "EXECUTION_FAILED", "Test"))
                continue
            history = repr(state.token_ids[-5:]).encode()
            token = hashlib.blake2b(history, digest_size=2).digest()[0] % VOCAB
            accepted = self.rng.randint(0, state.num_drafts) if state.speculated else 0
            self.verified_drafts += state.num_drafts if state.speculated else 0
            outcomes.append(SampledToken(state.request_id, token, num_accepted_drafts=accepted))
        return states, outcomes


@pytest.fixture
def worker(tiny_llama_dir: str) -> Worker:
    config = EngineConfig(
        model=tiny_llama_dir,
        cache=CacheConfig(block_size=BLOCK, kv_memory_bytes=4 << 20),
        kv_tiers=KVTierConfig(tiers=("host",), host_bytes=64 << 20, load_min_tokens=BLOCK),
    )
    return Worker(config)


def test_the_persistent_batch_equals_one_rebuilt_after_every_step(worker: Worker) -> None:
    rng = random.Random(53)
    runner = CheckingRunner(worker.runner, rng)
    worker.runner = runner  # type: ignore[assignment]
    tiers = TierPolicy(("host",), "through", load_min_tokens=BLOCK)
    # Fewer blocks than the worker's pool: preemptions happen; ids stay valid there.
    scheduler = make_scheduler(
        num_blocks=40,
        block_size=BLOCK,
        budget=24,
        chunk=8,
        max_seqs=8,
        speculative="ngram",
        tiers=tiers,
    )
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    loads = 0
    for step_index in range(2_000):
        if rng.random() < 0.3 and len(scheduler.requests) < 20:
            prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [
                rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))
            ]
            n = rng.choice((1, 1, 2, 3))  # n > 1: completions forking from one prompt
            tier_blocks = worker.kv_transfer.leading(hash_full_blocks(prompt, BLOCK))
            for index in range(n):
                scheduler.add_request(
                    f"r{step_index}/{index}",
                    prompt,
                    SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0),
                    group_id=f"g{step_index}" if n > 1 else "",
                    num_tier_blocks=tier_blocks,
                )
        if rng.random() < 0.04 and scheduler.requests:
            scheduler.abort(rng.choice(sorted(scheduler.requests)))
        plan = scheduler.schedule()
        loads += sum(1 for new in plan.new_requests if new.load_hashes)
        scheduler.update(plan, worker.execute(plan))
        tables = worker.requests.tables.table
        for state in worker.requests.values():
            assert tables[state.slot, : len(state.block_ids)].tolist() == state.block_ids
    for request_id in list(scheduler.requests):
        scheduler.abort(request_id)
    worker.execute(scheduler.schedule())
    assert not worker.requests and runner.checked_rows > 5_000
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.stats.forked > 0
    assert runner.verified_drafts > 0 and loads > 0


def test_a_slot_comes_back_however_a_request_leaves() -> None:
    held = HeldRequests(BlockTables(width=8))
    params = SamplingParams()
    states = [RequestState(f"r{i}", [1, 2], [i], 0, params, 2) for i in range(70)]
    for state in states:  # past the first 64 rows: the table grows
        held[state.request_id] = state
    assert len({s.slot for s in states}) == 70 and held.tables.table.shape[0] == 128
    held.pop("r0")
    del held["r1"]
    held["r2"] = RequestState("r2", [1], [9], 0, params, 1)  # rebuilt after preemption
    assert states[0].slot == states[1].slot == states[2].slot == -1
    held.clear()
    assert all(s.slot == -1 for s in states) and len(held.tables._free) == 128

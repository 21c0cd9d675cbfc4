"""The n completions of one request: the prompt computed once, its blocks shared, forks copied."""

from __future__ import annotations

import pytest

from services.scheduler.scheduler import Scheduler
from shared.sampling import SamplingParams
from shared.step import StepPlan
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import Pipeline, make_scheduler, run_to_completion

PROMPT = list(range(1, 11))  # 10 tokens: blocks of 4 hold 2 full blocks and a partial one


def add_group(
    scheduler: Scheduler, n: int, prompt: list[int] = PROMPT, max_tokens: int = 6
) -> list[str]:
    ids = [f"req/{index}" for index in range(n)]
    for request_id in ids:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        scheduler.add_request(request_id, prompt, params, group_id="req")
    return ids


def complete(scheduler: Scheduler, worker: FakeWorker, pending: StepPlan) -> dict[str, list[int]]:
    """Every request's tokens from `pending` (scheduled, not yet run) to the end."""
    outputs: dict[str, list[int]] = {}
    for output in scheduler.update(pending, worker.execute(pending)):
        outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    for request_id, tokens in run_to_completion(scheduler, worker).items():
        outputs.setdefault(request_id, []).extend(tokens)
    return outputs


def referenced_blocks(scheduler: Scheduler) -> int:
    return scheduler.block_manager.num_blocks - scheduler.block_manager.num_free_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_prompt_is_computed_once_and_its_full_blocks_shared(prefix_caching: bool) -> None:
    scheduler = make_scheduler(block_size=4, chunk=None, prefix_caching=prefix_caching)
    worker = FakeWorker(4)
    ids = add_group(scheduler, 3)
    first = scheduler.schedule()
    assert [r.request_id for r in first.new_requests] == ["req/0"]
    assert first.num_scheduled_tokens == len(PROMPT)
    (leader_first,) = scheduler.update(first, worker.execute(first))

    fork = scheduler.schedule()
    forks = {r.request_id: r for r in fork.new_requests}
    assert sorted(forks) == ["req/1", "req/2"]
    leader = scheduler.requests["req/0"]
    for plan in forks.values():
        assert plan.num_computed_tokens == len(PROMPT) - 1 and plan.num_scheduled_tokens == 1
        assert plan.block_ids[:2] == tuple(leader.block_ids[:2])  # shared, not recomputed
    # Each fork writes the prompt's last token into its own copy of the partial block.
    assert sorted(fork.block_copies) == sorted(
        (leader.block_ids[2], forks[i].block_ids[2]) for i in ("req/1", "req/2")
    )
    assert referenced_blocks(scheduler) == 2 + 3  # 9 blocks if each computed its own prompt
    assert all(scheduler.requests[i].num_cached_tokens == 0 for i in forks)  # not cache hits
    outputs = complete(scheduler, worker, fork)
    outputs["req/0"][:0] = leader_first.new_token_ids
    alone = make_scheduler(block_size=4, chunk=None, prefix_caching=prefix_caching)
    alone.add_request("alone", PROMPT, SamplingParams(max_tokens=6, temperature=0.0))
    expected = run_to_completion(alone, FakeWorker(4))["alone"]
    assert [outputs[i] for i in ids] == [expected] * 3
    assert referenced_blocks(scheduler) == 0


def test_a_prompt_ending_on_a_block_boundary_forks_with_no_copy() -> None:
    scheduler = make_scheduler(block_size=4, chunk=None)
    worker = FakeWorker(4)
    add_group(scheduler, 2, prompt=list(range(1, 10)))  # 8 shared tokens: two full blocks
    first = scheduler.schedule()
    scheduler.update(first, worker.execute(first))
    fork = scheduler.schedule()
    assert [r.num_computed_tokens for r in fork.new_requests] == [8]
    assert fork.block_copies == ()
    complete(scheduler, worker, fork)


def test_siblings_wait_for_a_chunked_prompt_then_fork() -> None:
    scheduler = make_scheduler(block_size=4, chunk=4, budget=4)
    worker = FakeWorker(4)
    add_group(scheduler, 3)
    for _ in range(3):  # 4 + 4 + 2 prompt tokens, one chunk a step
        plan = scheduler.schedule()
        assert {r.request_id for r in plan.new_requests} <= {"req/0"}
        scheduler.update(plan, worker.execute(plan))
    assert scheduler.requests["req/0"].num_output_tokens == 1
    plan = scheduler.schedule()
    assert {r.request_id for r in plan.new_requests} == {"req/1", "req/2"}
    complete(scheduler, worker, plan)
    assert scheduler.block_manager.stats.forked == 2 * 9


def test_a_member_whose_sibling_left_computes_the_prompt_itself() -> None:
    scheduler = make_scheduler(block_size=4, chunk=4, budget=4)
    worker = FakeWorker(4)
    add_group(scheduler, 2)
    plan = scheduler.schedule()
    scheduler.update(plan, worker.execute(plan))
    scheduler.abort("req/0")  # mid-prefill: req/1 no longer waits for it
    plan = scheduler.schedule()
    assert [(r.request_id, r.num_computed_tokens) for r in plan.new_requests] == [("req/1", 4)]
    outputs = complete(scheduler, worker, plan)
    assert len(outputs["req/1"]) == 6
    assert referenced_blocks(scheduler) == 0


def test_group_members_are_preempted_one_at_a_time_and_finish_the_same() -> None:
    """A member's own blocks are what make room; its siblings keep the shared prompt and go
    on (a whole group preempted at once comes back to the same point and runs out again)."""
    roomy = make_scheduler(block_size=4, chunk=4, budget=16)
    ids = add_group(roomy, 4, max_tokens=24)
    expected = run_to_completion(roomy, FakeWorker(4))

    tight = make_scheduler(num_blocks=14, block_size=4, chunk=4, budget=16)
    add_group(tight, 4, max_tokens=24)
    tight.add_request("other", [7] * 6, SamplingParams(max_tokens=24, temperature=0.0))
    worker = FakeWorker(4)
    outputs: dict[str, list[int]] = {}
    while tight.has_unfinished():
        plan = tight.schedule()
        for output in tight.update(plan, worker.execute(plan)):
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        tight.block_manager.check_invariants(list(tight.requests.values()))
    assert tight.num_preemptions > 0
    assert [outputs[i] for i in ids] == [expected[i] for i in ids]
    assert referenced_blocks(tight) == 0


@pytest.mark.parametrize("ahead", [False, True], ids=["lock-step", "planned-ahead"])
def test_a_group_larger_than_the_pool_makes_progress(ahead: bool) -> None:
    """n = 12 completions of 900 tokens where the pool holds 1,456 tokens: planned a step
    ahead, preempting the whole group each time it ran out sent it back to the same point
    (79,275 preemptions, 1,428 tokens in 20,000 steps). Now about the steps 12 separate
    requests take, and a preempted member resumes from its own cached blocks."""
    scheduler = make_scheduler(num_blocks=91, block_size=16, budget=2048, chunk=None, max_seqs=8)
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    for index in range(12):
        scheduler.add_request(f"req/{index}", [9, 9, 9], params, group_id="req")
    pipeline = Pipeline(scheduler, FakeWorker(200), ahead)
    tokens = 0
    for _step in range(3000):  # 12 separate requests: 2,161 (lock-step), 2,224 (ahead)
        if not scheduler.has_unfinished():
            break
        tokens += sum(len(output.new_token_ids) for output in pipeline.step())
    tokens += sum(len(output.new_token_ids) for output in pipeline.drain())
    assert not scheduler.has_unfinished(), (tokens, scheduler.num_preemptions)
    assert tokens == 12 * 900 and scheduler.num_preemptions < 300
    assert referenced_blocks(scheduler) == 0

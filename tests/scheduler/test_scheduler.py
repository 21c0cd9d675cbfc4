"""Scheduler behaviour with no model: budget, chunking, prefix hits, preemption, abort."""

from __future__ import annotations

import pytest

from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import make_scheduler, run_to_completion, step

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def test_each_step_stays_within_the_token_budget_and_chunk_size() -> None:
    scheduler = make_scheduler(budget=20, chunk=8)
    worker = FakeWorker(scheduler.block_size)
    for i in range(6):
        scheduler.add_request(f"r{i}", list(range(1, 30 + i)), GREEDY)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens <= 20
        for p in [*plan.new_requests, *plan.running_requests]:
            assert p.num_scheduled_tokens <= 8
        scheduler.update(plan, worker.execute(plan))


def test_decodes_are_scheduled_before_new_prefills() -> None:
    scheduler = make_scheduler(budget=10, chunk=8)
    worker = FakeWorker(scheduler.block_size)
    scheduler.add_request("first", [5] * 8, GREEDY)
    step(scheduler, worker)  # prefill of 'first'; it now decodes
    scheduler.add_request("second", [6] * 30, GREEDY)
    plan = scheduler.schedule()
    assert [p.request_id for p in plan.running_requests] == ["first"]
    assert plan.new_requests[0].request_id == "second"
    assert plan.new_requests[0].num_scheduled_tokens == 8  # chunk, within the 9 left


def test_unchunked_prefill_waits_for_a_step_with_room_for_all_of_it() -> None:
    scheduler = make_scheduler(budget=16, chunk=None)
    worker = FakeWorker(scheduler.block_size)
    scheduler.add_request("a", [1] * 10, GREEDY)
    scheduler.add_request("b", [2] * 10, GREEDY)
    plan = scheduler.schedule()
    assert [p.request_id for p in plan.new_requests] == ["a"]
    assert plan.new_requests[0].num_scheduled_tokens == 10
    scheduler.update(plan, worker.execute(plan))
    plan = scheduler.schedule()
    assert [p.num_scheduled_tokens for p in plan.new_requests] == [10]


def test_prefix_hit_starts_computed_tokens_at_the_cached_blocks() -> None:
    scheduler = make_scheduler(block_size=4)
    worker = FakeWorker(4)
    shared = list(range(10, 23))  # 13 tokens: 3 full blocks
    scheduler.add_request("a", [*shared, 1, 2], GREEDY)
    run_to_completion(scheduler, worker)
    scheduler.add_request("b", [*shared, 7, 8, 9], GREEDY)
    plan = scheduler.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 12
    assert new.num_scheduled_tokens == 16 - 12
    assert scheduler.block_manager.stats.hits == 12
    scheduler.update(plan, worker.execute(plan))  # the fake worker re-reads every cached slot
    run_to_completion(scheduler, worker)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = make_scheduler(block_size=4)
    worker = FakeWorker(4)
    prompt = list(range(30, 38))  # exactly 2 blocks
    scheduler.add_request("a", prompt, GREEDY)
    first = run_to_completion(scheduler, worker)["a"]
    scheduler.add_request("b", prompt, GREEDY)
    (new,) = scheduler.schedule().new_requests
    assert new.num_computed_tokens == 4 and new.num_scheduled_tokens == 4
    scheduler.abort("b")
    scheduler.add_request("c", prompt, GREEDY)
    assert run_to_completion(scheduler, worker)["c"] == first


def test_prefix_caching_off_never_hits() -> None:
    scheduler = make_scheduler(prefix_caching=False)
    worker = FakeWorker(scheduler.block_size)
    for name in "ab":
        scheduler.add_request(name, list(range(40)), GREEDY)
        run_to_completion(scheduler, worker)
    assert scheduler.block_manager.stats.hits == 0


def test_hash_hit_with_different_tokens_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.scheduler.request as request_module

    monkeypatch.setattr(request_module, "hash_block", lambda parent, tokens, salt=b"": 42)
    scheduler = make_scheduler(block_size=4)
    worker = FakeWorker(4)
    scheduler.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    run_to_completion(scheduler, worker)
    scheduler.add_request("b", [9, 9, 9, 9, 5], GREEDY)
    (new,) = scheduler.schedule().new_requests
    assert new.num_computed_tokens == 0
    assert scheduler.block_manager.stats.collisions == 1


def test_preempted_requests_resume_to_identical_output() -> None:
    prompts = {f"r{i}": [i + 1] * (9 + 3 * i) for i in range(6)}
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, budget=64, chunk=8)
        for request_id, prompt in prompts.items():
            scheduler.add_request(request_id, prompt, params)
        outputs = run_to_completion(scheduler, FakeWorker(4))
        return outputs, scheduler.num_preemptions

    roomy, roomy_preemptions = run(num_blocks=200)
    tight, tight_preemptions = run(num_blocks=24)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy


def test_lower_priority_value_is_admitted_first() -> None:
    scheduler = make_scheduler(budget=8, chunk=8, max_seqs=1)
    scheduler.add_request("late-but-urgent", [1] * 4, GREEDY, priority=-1)
    scheduler.add_request("normal", [2] * 4, GREEDY)
    scheduler.requests["normal"].arrival_seq = -5  # arrived earlier still loses to priority
    plan = scheduler.schedule()
    assert [p.request_id for p in plan.new_requests] == ["late-but-urgent"]


def test_abort_frees_blocks_before_the_next_plan() -> None:
    scheduler = make_scheduler(num_blocks=32)
    worker = FakeWorker(scheduler.block_size)
    scheduler.add_request("a", list(range(20)), SamplingParams(max_tokens=50))
    step(scheduler, worker)
    step(scheduler, worker)
    assert scheduler.block_manager.num_free_blocks < 32
    output = scheduler.abort("a")
    assert output is not None and output.finish_reason == FinishReason.FINISH_REASON_ABORT
    assert scheduler.block_manager.num_free_blocks == 32
    plan = scheduler.schedule()
    assert plan.finished_request_ids == ("a",)
    assert scheduler.abort("a") is None  # exactly one terminal event


def test_stop_conditions_finish_with_the_right_reason() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(scheduler.block_size, vocab=3)
    scheduler.add_request("len", [1, 2], SamplingParams(max_tokens=3))
    scheduler.add_request("stop", [1, 2], SamplingParams(max_tokens=100, stop_token_ids=(0, 1, 2)))
    reasons = {}
    while scheduler.has_unfinished():
        for output in step(scheduler, worker):
            if output.finished:
                reasons[output.request_id] = (output.finish_reason, len(output.new_token_ids))
    assert reasons["len"][0] == FinishReason.FINISH_REASON_LENGTH
    assert reasons["stop"][0] == FinishReason.FINISH_REASON_STOP


def test_prompts_that_cannot_run_are_refused_at_submit() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=16, chunk=None)
    with pytest.raises(KvmeshError) as empty:
        scheduler.add_request("e", [], GREEDY)
    assert empty.value.reason is Reason.EMPTY_PROMPT
    with pytest.raises(KvmeshError) as over_budget:
        scheduler.add_request("b", [1] * 17, GREEDY)
    assert over_budget.value.reason is Reason.PROMPT_TOO_LONG
    with pytest.raises(KvmeshError) as over_pool:
        scheduler.add_request("p", [1] * 32, GREEDY)  # the pool holds 32 tokens: none left
    assert over_pool.value.reason is Reason.PROMPT_TOO_LONG
    scheduler.add_request("ok", [1] * 8, GREEDY)
    with pytest.raises(KvmeshError) as duplicate:
        scheduler.add_request("ok", [1] * 8, GREEDY)
    assert duplicate.value.reason is Reason.INVALID_ARGUMENT


def test_a_request_that_outgrows_the_pool_ends_with_length() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=16, chunk=8)
    scheduler.add_request("a", [1] * 10, SamplingParams(max_tokens=100))
    outputs = run_to_completion(scheduler, FakeWorker(4))
    assert len(outputs["a"]) == 16 - 10
    assert scheduler.block_manager.num_free_blocks == 4


def test_hit_statistics_count_each_admission_once() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    worker = FakeWorker(4)
    shared = list(range(1, 13))
    scheduler.add_request("a", [*shared, 50], SamplingParams(max_tokens=1))
    run_to_completion(scheduler, worker)
    request = scheduler.add_request("b", [*shared, 51, 52], SamplingParams(max_tokens=1))
    manager = scheduler.block_manager
    before = manager.stats.hits
    for _ in range(3):  # looking, as the scheduler does each step a request waits, is free
        assert manager.match_prefix(request).num_tokens == 12
    assert manager.stats.hits == before
    run_to_completion(scheduler, worker)
    assert manager.stats.hits == before + 12

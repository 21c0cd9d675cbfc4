"""Tenants share a scheduler fairly within a priority: a flooding tenant's queue does not keep
another tenant's requests waiting, and preemption takes from the tenant holding the most."""

from __future__ import annotations

from services.scheduler.fair_share import queues_past_bound
from shared.sampling import SamplingParams
from shared.step import FailedRequest, StepResult
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import make_scheduler, run_to_completion

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _admitted(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return [p.request_id for p in plan.new_requests]


def test_a_light_tenant_is_admitted_ahead_of_a_flooding_tenants_queue() -> None:
    scheduler = make_scheduler(max_seqs=2, budget=64, chunk=None)
    for index in range(6):
        scheduler.add_request(f"a{index}", [1, 2, 3, index], PARAMS, tenant="a")
    scheduler.add_request("b0", [4, 5, 6], PARAMS, tenant="b")
    scheduler.add_request("b1", [4, 5, 7], PARAMS, tenant="b")
    worker = FakeWorker(4)
    first = scheduler.schedule()
    # The oldest first (no one holds anything), then b: a already holds blocks.
    assert _admitted(first) == ["a0", "b0"]
    scheduler.update(first, worker.execute(first))
    order: list[str] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        order += _admitted(plan)
        scheduler.update(plan, worker.execute(plan))
    # As slots free, b's second request does not wait for the rest of a's flood.
    assert order.index("b1") < order.index("a2")
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_one_tenant_alone_is_plain_fcfs() -> None:
    scheduler = make_scheduler(max_seqs=1, budget=64, chunk=None)
    for index in range(4):
        scheduler.add_request(f"r{index}", [1, index], PARAMS, tenant="solo")
    worker = FakeWorker(4)
    order: list[str] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        order += _admitted(plan)
        scheduler.update(plan, worker.execute(plan))
    assert order == ["r0", "r1", "r2", "r3"]


def test_weight_buys_a_larger_share() -> None:
    scheduler = make_scheduler(max_seqs=3, budget=64, chunk=None)
    for index in range(4):
        scheduler.add_request(f"a{index}", [1, 2, 3, index], PARAMS, tenant="a", tenant_weight=2)
    for index in range(4):
        scheduler.add_request(f"b{index}", [4, 5, 6, index], PARAMS, tenant="b")
    # a0 (oldest), b0 (holds 0), then a1: a holds 1 block at weight 2 (0.5) < b's 1 block.
    assert _admitted(scheduler.schedule()) == ["a0", "b0", "a1"]


def test_preemption_takes_the_newest_request_of_the_tenant_holding_most() -> None:
    # 12 blocks of 4 tokens: a's three requests and b's one fill the pool as they grow.
    scheduler = make_scheduler(num_blocks=12, block_size=4, budget=64, chunk=None, max_seqs=8)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for index in range(3):
        scheduler.add_request(f"a{index}", [1, 2, 3, 4, 5, 6, 7, index], long, tenant="a")
    scheduler.add_request("b0", [8, 9, 10, 11, 12, 13, 14], long, tenant="b")
    worker = FakeWorker(4)
    victims: list[str] = []
    for _ in range(40):
        before = scheduler.num_preemptions
        plan = scheduler.schedule()
        if scheduler.num_preemptions > before:
            victims += list(plan.finished_request_ids)
        scheduler.update(plan, worker.execute(plan))
        if victims:
            break
    assert victims and all(v.startswith("a") for v in victims), victims
    assert victims[0] == "a2"  # a's newest


def test_a_failed_request_frees_its_blocks_and_leaves_the_cache() -> None:
    scheduler = make_scheduler(budget=64, chunk=None)
    scheduler.add_request("ok", [1, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS)
    scheduler.add_request("bad", [9, 8, 7, 6, 5, 4, 3, 2, 1], PARAMS)
    plan = scheduler.schedule()
    worker = FakeWorker(4)
    result = worker.execute(plan)
    failure = FailedRequest("bad", "EXECUTION_FAILED", "ValueError")
    sampled = tuple(s for s in result.sampled if s.request_id != "bad")
    outputs = scheduler.update(plan, StepResult(plan.step_id, sampled, (failure,)))
    failed = [o for o in outputs if o.failure is not None]
    assert [o.request_id for o in failed] == ["bad"] and failed[0].finished
    assert "bad" not in scheduler.requests
    assert run_to_completion(scheduler, worker)  # "ok" goes on
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    # Nothing of the failed prompt is findable; the good one's full blocks are.
    probe = scheduler.add_request("probe", [9, 8, 7, 6, 5, 4, 3, 2, 1], PARAMS)
    assert manager.cached_prefix_tokens(probe) == 0


def test_a_tenant_holding_every_slot_gives_one_back_to_a_waiting_tenant() -> None:
    scheduler = make_scheduler(max_seqs=2, budget=64, chunk=None)
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    worker = FakeWorker(4)
    for index in range(4):
        scheduler.add_request(f"a{index}", [1, 2, 3, index], long, tenant="a")
    for _ in range(3):  # a0 and a1 hold both slots, a2 and a3 wait
        plan = scheduler.schedule()
        scheduler.update(plan, worker.execute(plan))
    assert {r.request_id for r in scheduler.running} == {"a0", "a1"}
    scheduler.add_request("b0", [7, 8, 9], long, tenant="b")
    plan = scheduler.schedule()
    assert _admitted(plan) == ["b0"] and plan.finished_request_ids == ("a1",)  # a's newest
    scheduler.update(plan, worker.execute(plan))
    # Now even (one each): a's waiting requests do not take b's slot back.
    for _ in range(5):
        plan = scheduler.schedule()
        assert not plan.finished_request_ids
        scheduler.update(plan, worker.execute(plan))
    assert {r.tenant for r in scheduler.running} == {"a", "b"}


def test_a_below_share_tenants_prefill_runs_before_the_others_decodes() -> None:
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    steps = {}
    for prefill_first in (True, False):
        worker = FakeWorker(4)
        scheduler = make_scheduler(
            max_seqs=4, budget=64, chunk=None, fair_prefill_first=prefill_first
        )
        for index in range(2):
            scheduler.add_request(f"a{index}", [1, 2, 3, index], long, tenant="a")
        for _ in range(3):  # a0 and a1 decode
            plan = scheduler.schedule()
            scheduler.update(plan, worker.execute(plan))
        scheduler.add_request("b0", [7, 8, 9], long, tenant="b")
        scheduler.add_request("b1", [7, 8, 10], long, tenant="b")
        steps[prefill_first] = plan = scheduler.schedule()
        scheduler.update(plan, worker.execute(plan))
        # b now holds as much as a: the next steps are mixed again, every request decoding.
        plan = scheduler.schedule()
        assert sorted(p.request_id for p in plan.running_requests) == ["a0", "a1", "b0", "b1"]
        assert run_to_completion(scheduler, worker) and not scheduler.has_unfinished()
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert _admitted(steps[True]) == ["b0", "b1"] and not steps[True].running_requests
    assert _admitted(steps[False]) == ["b0", "b1"] and len(steps[False].running_requests) == 2


def test_prefill_first_never_jumps_more_urgent_decodes() -> None:
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    worker = FakeWorker(4)
    scheduler = make_scheduler(max_seqs=4, budget=64, chunk=None)
    scheduler.add_request("a0", [1, 2, 3], long, tenant="a", priority=-1)
    scheduler.add_request("solo0", [1, 2, 4], long, tenant="solo")
    plan = scheduler.schedule()
    scheduler.update(plan, worker.execute(plan))
    scheduler.add_request("b0", [7, 8, 9], long, tenant="b")  # below its share, less urgent
    scheduler.add_request("solo1", [1, 2, 5], long, tenant="solo")
    plan = scheduler.schedule()
    assert {p.request_id for p in plan.running_requests} == {"a0", "solo0"}


def test_slots_count_requests_not_blocks_so_few_long_requests_still_get_a_slot() -> None:
    # b's one request holds more blocks (a long prompt) than a's three short ones together;
    # counted by blocks b would be "above" a and wait behind a's flood for a slot.
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_seqs=4, budget=64, chunk=None)
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    worker = FakeWorker(4)
    scheduler.add_request("b0", list(range(10, 50)), long, tenant="b")
    for index in range(6):
        scheduler.add_request(f"a{index}", [1, 2, index], long, tenant="a")
    for _ in range(3):
        plan = scheduler.schedule()
        scheduler.update(plan, worker.execute(plan))
    assert {r.request_id for r in scheduler.running} == {"b0", "a0", "a1", "a2"}
    held = {t: sum(len(r.block_ids) for r in scheduler.running if r.tenant == t) for t in "ab"}
    assert held["b"] > held["a"]
    scheduler.add_request("b1", [7, 8, 9], long, tenant="b")
    plan = scheduler.schedule()
    assert _admitted(plan) == ["b1"] and plan.finished_request_ids == ("a2",)
    scheduler.update(plan, worker.execute(plan))
    assert run_to_completion(scheduler, worker) and not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_a_full_queue_still_takes_a_tenant_below_its_share_of_it() -> None:
    scheduler = make_scheduler(max_seqs=2, budget=64, chunk=None)
    for index in range(4):
        scheduler.add_request(f"a{index}", [1, 2, 3, index], PARAMS, tenant="a")
    waiting, running = scheduler.waiting, scheduler.running
    # a fills the bound of 4 alone: a gets no more, b (half of 4) gets 2.
    assert not queues_past_bound("a", 1.0, waiting, running, 4)
    assert queues_past_bound("b", 1.0, waiting, running, 4)
    scheduler.add_request("b0", [4, 5, 6], PARAMS, tenant="b")
    assert queues_past_bound("b", 1.0, scheduler.waiting, running, 4)
    scheduler.add_request("b1", [4, 5, 7], PARAMS, tenant="b")
    assert not queues_past_bound("b", 1.0, scheduler.waiting, running, 4)
    # A weight of 3 is 3 of every 4 places; twice the bound is the end, whoever asks.
    assert queues_past_bound("c", 3.0, scheduler.waiting, running, 4)
    assert not queues_past_bound("c", 3.0, scheduler.waiting, running, 3)

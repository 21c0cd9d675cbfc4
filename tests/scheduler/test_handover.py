"""The scheduler's side of the prefill/decode split, without a worker process: a prefill-only
request's blocks held under a lease until released; a handed-over request's planned load,
recomputed or failed when it falls short."""

from __future__ import annotations

import pytest

from services.scheduler.tier_loads import TierPolicy
from shared.errors import Reason
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import make_scheduler, run_to_completion

PROMPT = list(range(1, 19))  # 4 full blocks of 4, and 2 tokens


def test_a_prefill_only_request_keeps_its_blocks_until_its_lease_is_released() -> None:
    scheduler = make_scheduler(num_blocks=16)
    worker = FakeWorker(4)
    request = scheduler.add_request("p", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True))
    request.prefill_only = True
    outputs = run_to_completion(scheduler, worker)
    assert len(outputs["p"]) == 1
    assert request.finish_reason is FinishReason.FINISH_REASON_LENGTH
    assert list(scheduler.leases) == ["p"] and "p" not in scheduler.requests
    held = scheduler.block_manager.num_free_blocks
    assert held <= 16 - 5  # its five blocks, still referenced
    plan = scheduler.schedule()
    assert "p" not in plan.finished_request_ids  # the worker keeps it: its export reads it
    scheduler.release_lease("p")
    assert not scheduler.leases and scheduler.block_manager.num_free_blocks == held + 5
    assert scheduler.schedule().finished_request_ids == ("p",)
    scheduler.release_lease("p")  # a second release (expiry after a close) is a no-op


def test_a_prefill_only_request_that_stops_at_once_holds_nothing() -> None:
    scheduler = make_scheduler(num_blocks=16)
    worker = FakeWorker(4)
    first = step_until_sampled(scheduler, worker, SamplingParams(max_tokens=1, ignore_eos=True))
    # The same prompt again, with that token as a stop: it ends with STOP, no lease.
    request = scheduler.add_request(
        "q", PROMPT, SamplingParams(max_tokens=1, stop_token_ids=(first,))
    )
    request.prefill_only = True
    run_to_completion(scheduler, worker)
    assert request.finish_reason is FinishReason.FINISH_REASON_STOP
    assert "q" not in scheduler.leases


def step_until_sampled(scheduler, worker, sampling: SamplingParams) -> int:  # type: ignore[no-untyped-def]
    scheduler.add_request("probe", PROMPT, sampling)
    return run_to_completion(scheduler, worker)["probe"][0]


@pytest.mark.parametrize("fail", [False, True])
def test_a_short_handover_load_is_recomputed_or_fails_by_policy(fail: bool) -> None:
    # No tiers of its own, and a load line far above these blocks: a handover loads anyway.
    policy = TierPolicy(tiers=(), load_min_tokens=1024, fail_handovers=fail)
    scheduler = make_scheduler(num_blocks=32, tiers=policy)
    worker = FakeWorker(4, tiers=True)
    request = scheduler.add_request(
        "d", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), num_tier_blocks=4
    )
    request.handed_over = True
    # Two of the four pulled blocks reached the worker; the load stops at the third.
    assert worker.tier is not None
    for index, block_hash in enumerate(request.full_block_hashes(4)[:2]):
        worker.tier[block_hash] = tuple(PROMPT[index * 4 : index * 4 + 4])
    plan = scheduler.schedule()
    assert len(plan.new_requests[0].load_hashes) == 4
    outputs = scheduler.update(plan, worker.execute(plan))
    if fail:
        assert [o.failure.reason for o in outputs if o.failure] == [Reason.KV_HANDOVER_FAILED.value]
        assert not scheduler.requests and scheduler.block_manager.num_free_blocks == 32
        return
    assert not outputs and request.num_computed_tokens == 8  # on from the two that loaded
    assert len(run_to_completion(scheduler, worker)["d"]) == 3
    assert scheduler.tier_loads.stats.recomputed_tokens == 8

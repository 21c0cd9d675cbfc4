"""The block manager's stored/evicted events: what the scheduler publishes to Redis."""

from __future__ import annotations

from shared.block_hash import hash_full_blocks
from shared.sampling import SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import make_scheduler, run_to_completion

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def test_computed_blocks_are_stored_events_with_the_same_hashes_as_the_gateway() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    events = scheduler.block_manager.events
    events.needs_resync = False  # as after a publisher's first resync
    prompt = list(range(1, 14))  # 3 full blocks and a partial one
    scheduler.add_request("a", prompt, ONE_TOKEN, cache_salt=b"tenant-a")
    run_to_completion(scheduler, FakeWorker(4))
    delta = events.drain()
    assert delta.stored == {b"tenant-a": hash_full_blocks(prompt, 4, b"tenant-a")}
    assert delta.evicted == {}
    assert len(events.drain()) == 0  # drained


def test_evicted_blocks_are_published_once_and_a_store_then_evict_cancels_out() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, chunk=None)
    events = scheduler.block_manager.events
    events.needs_resync = False
    first = [7] * 12
    scheduler.add_request("first", first, ONE_TOKEN)
    run_to_completion(scheduler, FakeWorker(4))
    published = events.drain().stored[b""]
    # A different prompt needs every block: the first prompt's cached blocks are evicted.
    second = list(range(100, 115))
    scheduler.add_request("second", second, ONE_TOKEN)
    run_to_completion(scheduler, FakeWorker(4))
    delta = events.drain()
    assert sorted(delta.evicted[b""]) == sorted(published)
    assert delta.stored[b""] == hash_full_blocks(second, 4)[:3]
    assert scheduler.block_manager.cached_hashes() == {b"": delta.stored[b""]}


def test_the_log_is_bounded_and_asks_for_a_resync_instead_of_growing() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=64, chunk=None)
    events = scheduler.block_manager.events
    events.needs_resync = False
    for index in range(20):  # far more distinct blocks than the limit of 4 x 8
        scheduler.add_request(f"r{index}", [index + 1] * 16, ONE_TOKEN)
        run_to_completion(scheduler, FakeWorker(4))
    assert events.needs_resync
    assert len(events.drain()) == 0

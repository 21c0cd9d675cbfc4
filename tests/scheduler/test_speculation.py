"""Draft proposers and the scheduler's side of speculative decoding: proposals, adaptive
lengths, and a seeded random run with drafts, rollbacks, aborts, failures and preemption that
must leak no block and give the outputs a run without drafts gives."""

from __future__ import annotations

import random

import pytest

from services.scheduler.request import Request
from services.scheduler.speculation import (
    PROBE_EVERY,
    NgramProposer,
    Speculator,
    SuffixProposer,
    SuffixTrie,
)
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import fail_one, make_scheduler


def request(tokens: list[int], prompt_len: int | None = None, rid: str = "r") -> Request:
    made = Request(rid, list(tokens[:prompt_len]), SamplingParams(max_tokens=100), 0)
    made.token_ids = list(tokens)
    return made


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_match() -> None:
    proposer = NgramProposer(2, 3)
    # "7 8" occurs twice before the end; the latest occurrence is followed by 5 6.
    tokens = [7, 8, 1, 2, 9, 7, 8, 5, 6, 3, 7, 8]
    assert proposer.propose(request(tokens), 3) == [5, 6, 3]
    assert proposer.propose(request(tokens), 1) == [5]
    assert NgramProposer(2, 3).propose(request([1, 2, 3, 4]), 4) == []  # nothing repeats
    # The index grows with the request: a later call sees the tokens appended since.
    grown = request(tokens)
    proposer.propose(grown, 2)
    grown.token_ids += [5, 6]
    assert proposer.propose(grown, 2) == [3, 7]  # "5 6" was followed by 3 7


def test_suffix_trie_counts_continuations_and_forgets_removed_sequences() -> None:
    trie = SuffixTrie(depth=4)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    trie.extend(tokens, 0, len(tokens))
    token, matched, share = trie.next_token([9, 1, 2])
    assert (token, matched) == (3, 2) and share == pytest.approx(2 / 3)
    trie.extend(tokens, 0, len(tokens), delta=-1)
    assert trie.next_token([1, 2]) is None and trie.root[1] == {}


def test_suffix_proposer_learns_from_the_request_and_from_finished_outputs() -> None:
    proposer = SuffixProposer(depth=6, shared_outputs=2)
    own = request([5, 6, 7, 8, 9, 1, 5, 6], prompt_len=8)
    assert proposer.propose(own, 3) == [7, 8, 9]
    # Another request's output, once finished, is proposed to a request that starts it again.
    done = request([40, 41, 20, 21, 22, 23, 24], prompt_len=2, rid="done")
    proposer.forget(done)
    fresh = request([50, 20, 21], prompt_len=3, rid="fresh")
    assert proposer.propose(fresh, 3) == [22, 23, 24]
    # Another tenant's request (its own cache salt) learns nothing from that output.
    salted = request([50, 20, 21], prompt_len=3, rid="salted")
    salted.cache_salt = b"tenant-b"
    assert proposer.propose(salted, 3) == []
    for index in range(2):  # the shared trie holds the last two outputs only
        proposer.forget(request([60, 70 + index, 71 + index], prompt_len=1, rid=f"x{index}"))
    assert proposer.propose(request([51, 20, 21], prompt_len=3, rid="late"), 3) == []


def test_proposal_length_follows_acceptance_and_batch_size() -> None:
    scheduler = make_scheduler(num_blocks=64, speculative="ngram")
    config = SpeculativeConfig("ngram", max_draft_tokens=6, draft_row_cost=0.14)
    speculator = Speculator(config, scheduler.block_manager, 4096)
    made = request([1, 2, 3] * 10, prompt_len=20)

    def length(batch: int = 1) -> int:
        return len(speculator.drafts(made, 1, 100, batch))

    assert length() == 2  # a new request: acceptance 0.5, 0.5**3 < the bar of 0.14
    speculator.settle(made, 2, 2)  # all accepted: 0.7, and 0.7**5 >= 0.14
    assert length() == 5
    assert length(batch=8) == 1  # the bar at 8 requests: 0.63
    for _ in range(4):  # rejections bring it below the bar even alone
        speculator.settle(made, 3, 0)
    assert [length() for _ in range(PROBE_EVERY - 1)] == [0] * (PROBE_EVERY - 1)
    assert length() == 1  # a probe now and then
    speculator.settle(made, 1, 1)
    speculator.settle(made, 1, 1)
    assert length() > 0 and length(batch=64) == 0  # above the highest bar: no drafts
    assert made.num_draft_tokens == 16 and made.num_accepted_drafts == 4
    # A prefill chunk, a request with no output yet, or one that opted out, never drafts.
    assert speculator.drafts(made, 5, 100, 1) == ()
    assert speculator.drafts(request([1, 2, 1, 2], prompt_len=4), 1, 100, 1) == ()
    opted_out = request([1, 2, 3] * 10, prompt_len=20)
    opted_out.sampling = SamplingParams(max_tokens=100, disable_speculation=True)
    assert speculator.drafts(opted_out, 1, 100, 1) == ()


def outputs_of(speculative: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    scheduler = make_scheduler(
        num_blocks=48, block_size=4, budget=32, chunk=8, max_seqs=6, speculative=speculative
    )
    worker = FakeWorker(4, vocab=3)
    outputs: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        rid = f"r{index}"
        outputs[rid] = []
        scheduler.add_request(rid, prompt, SamplingParams(max_tokens=30, temperature=0.0))
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        for output in scheduler.update(plan, worker.execute(plan)):
            outputs[output.request_id] += output.new_token_ids
        scheduler.block_manager.check_invariants(list(scheduler.requests.values()))
    assert scheduler.block_manager.num_free_blocks == 48
    return outputs


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_change_no_output(method: str) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    plain = outputs_of("off", prompts)
    assert outputs_of(method, prompts) == plain
    assert all(len(tokens) == 30 for tokens in plain.values())


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_random_run_with_drafts_rollbacks_aborts_and_preemption_leaks_no_block(
    method: str,
) -> None:
    rng = random.Random(99)
    scheduler = make_scheduler(
        num_blocks=14, block_size=4, budget=24, chunk=8, max_seqs=8, speculative=method
    )
    worker = FakeWorker(4, vocab=4)
    next_id = finished = aborted = failed = 0
    for _ in range(4000):
        if rng.random() < 0.3 and len(scheduler.requests) < 16:
            prompt = [rng.randrange(4) for _ in range(rng.randint(1, 16))]
            params = SamplingParams(max_tokens=rng.randint(1, 60), stop_token_ids=(3,))
            scheduler.add_request(f"r{next_id}", prompt, params, priority=rng.randint(0, 2))
            next_id += 1
        if rng.random() < 0.05 and scheduler.requests:
            scheduler.abort(rng.choice(sorted(scheduler.requests)))
            aborted += 1
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens <= 24
        result = worker.execute(plan)
        if result.sampled and rng.random() < 0.03:
            result = fail_one(result, rng)
            failed += 1
        for output in scheduler.update(plan, result):
            finished += output.finished
        scheduler.block_manager.check_invariants(list(scheduler.requests.values()))
    speculator = scheduler.speculator
    assert finished > 300 and aborted > 50 and failed > 20 and scheduler.num_preemptions > 0
    assert speculator.num_accepted_drafts > 100
    assert speculator.num_draft_tokens > speculator.num_accepted_drafts  # rollbacks happened
    for request_id in list(scheduler.requests):
        scheduler.abort(request_id)
    scheduler.block_manager.check_invariants([])
    assert scheduler.block_manager.num_free_blocks == 14

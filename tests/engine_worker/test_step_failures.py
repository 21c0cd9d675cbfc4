"""One request that raises inside a step fails alone: the rest of its batch keeps its tokens.

On the real default model through the in-process engine (the real worker and scheduler): a
fault injected into one request of a running batch of 8, a sampler row that raises, a forward
pass that raises only with one request in it, and the circuit breaker's counting.
"""

from __future__ import annotations

import llguidance
import pytest
import torch

from kvmesh.engine import Engine
from services.engine_worker.grammar import GrammarCompiler, grammar_of
from services.engine_worker.sampler import sample
from services.engine_worker.step_failures import (
    CircuitBreaker,
    FaultInjector,
    FaultRule,
    InjectedFault,
)
from services.engine_worker.step_inputs import RequestState
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.sampling import ResponseFormat, SamplingParams
from shared.step import FailedRequest, SampledToken
from shared.text_tokenizer import load_tokenizer

POISON = 7777  # a token id only the poisoned prompt holds
PROMPTS = [[100 + 37 * i + j for j in range(20 + 3 * i)] for i in range(8)]
POISONED = 3


@pytest.fixture(scope="module")
def engine(default_model_path: str) -> Engine:
    return Engine(
        EngineConfig(
            model=default_model_path,
            cache=CacheConfig(kv_memory_bytes=64 << 20),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, prefill_chunk_size=64),
        )
    )


def _no_blocks_held(engine: Engine) -> None:
    manager = engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants([])
    engine.step()  # the next plan tells the worker which requests ended
    assert not engine.worker.requests


def test_an_injected_fault_fails_one_request_of_eight_and_the_rest_match_a_clean_run(
    engine: Engine,
) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    params = [greedy if i % 2 else seeded for i in range(8)]
    prompts = [list(p) for p in PROMPTS]
    prompts[POISONED][5] = POISON
    clean = engine.generate(prompts, params)
    assert all(c.error is None and len(c.token_ids) == 8 for c in clean)
    engine.worker.faults = FaultInjector((FaultRule(POISON, after_tokens=2),))
    try:
        faulted = engine.generate(prompts, params)
    finally:
        engine.worker.faults = None
    failed = faulted[POISONED]
    assert failed.error == "EXECUTION_FAILED" and failed.finish_reason is None
    assert failed.token_ids == clean[POISONED].token_ids[:2]  # what it had before the fault
    for index, (before, after) in enumerate(zip(clean, faulted, strict=True)):
        if index != POISONED:
            assert after.error is None and after.token_ids == before.token_ids, index
    _no_blocks_held(engine)
    # The failed request's blocks left the prefix cache: its prompt is computed afresh.
    again = engine.generate([prompts[POISONED]], params[POISONED])[0]
    assert again.token_ids == clean[POISONED].token_ids and again.cached_tokens == 0


def test_a_forward_pass_that_raises_is_retried_request_by_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [list(p) for p in PROMPTS[:4]]
    prompts[1][0] = POISON
    clean = engine.generate(prompts, greedy)
    runner_step = engine.worker.runner.step

    def step_refusing_poison(scheduled, rng):  # type: ignore[no-untyped-def]
        if any(POISON in state.token_ids for state, _ in scheduled):
            raise RuntimeError("a kernel refused this batch")
        return runner_step(scheduled, rng)

    monkeypatch.setattr(engine.worker.runner, "step", step_refusing_poison)
    faulted = engine.generate(prompts, greedy)
    assert faulted[1].error == "EXECUTION_FAILED" and not faulted[1].token_ids
    for index in (0, 2, 3):
        assert faulted[index].token_ids == clean[index].token_ids
    _no_blocks_held(engine)


class _BrokenMatcher:
    def consume_token(self, token: int) -> None:
        raise ValueError("grammar state corrupted")


def test_a_row_with_nan_logits_fails_alone() -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    states = [RequestState(f"r{i}", [1, 2], [0], 1, params, 2) for i in range(4)]
    logits = torch.randn(4, 64)
    logits[2, 5] = float("nan")
    outcomes = sample(logits, states, torch.Generator().manual_seed(0))
    assert isinstance(outcomes[2], FailedRequest) and outcomes[2].error_type == "NonFiniteLogits"
    for row in (0, 1, 3):
        assert isinstance(outcomes[row], SampledToken)
        assert outcomes[row].token_id == int(logits[row].argmax())


def test_infinities_fail_their_rows_and_a_finite_row_whose_sum_overflows_does_not() -> None:
    """The check sums each row first: a sum past float32's range is no failure on its own."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    states = [RequestState(f"r{i}", [1, 2], [0], 1, params, 2) for i in range(4)]
    logits = torch.randn(4, 64)
    logits[0, 3], logits[1, 7], logits[1, 8] = float("inf"), float("inf"), float("-inf")
    logits[2, :4] = 3e38  # finite, sums to inf
    outcomes = sample(logits, states, torch.Generator().manual_seed(0))
    assert [isinstance(o, FailedRequest) for o in outcomes] == [True, True, False, False]
    assert isinstance(outcomes[2], SampledToken) and outcomes[2].token_id in range(4)


def test_a_matcher_that_raises_fails_only_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.engine_worker.sampler as sampler

    monkeypatch.setattr(sampler, "allowed_tokens", lambda m, n: torch.ones(n, dtype=torch.bool))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    states = [RequestState(f"r{i}", [1, 2], [0], 1, params, 2) for i in range(3)]
    states[0].matcher = _BrokenMatcher()  # type: ignore[assignment]
    outcomes = sample(torch.randn(3, 32), states, torch.Generator())
    assert isinstance(outcomes[0], FailedRequest) and outcomes[0].error_type == "ValueError"
    assert outcomes[0].reason == "EXECUTION_FAILED"
    assert all(isinstance(o, SampledToken) for o in outcomes[1:])


def test_a_row_whose_own_parameters_leave_no_finite_mass_fails_alone() -> None:
    """Unvalidated parameters (the gateway refuses these; a row can still come out so): the
    row fails with INVALID_SAMPLING_PARAMS, which the breaker never counts."""
    bad = SamplingParams(max_tokens=4, temperature=1.0, repetition_penalty=1e-300)
    good = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    states = [RequestState("bad", [1, 2], [0], 1, bad, 2)]
    states += [RequestState(f"r{i}", [1, 2], [0], 1, good, 2) for i in range(2)]
    outcomes = sample(torch.randn(3, 32) + 5.0, states, torch.Generator())
    assert isinstance(outcomes[0], FailedRequest)
    assert (outcomes[0].reason, outcomes[0].error_type) == (
        "INVALID_SAMPLING_PARAMS",
        "NoSamplingMass",
    )
    assert all(isinstance(o, SampledToken) for o in outcomes[1:])


def test_a_grammar_that_can_go_no_further_fails_its_row_alone(default_model_path: str) -> None:
    """Never a free sample past a broken grammar (that was a 500 INVALID_OUTPUT at the end):
    the row fails INVALID_SCHEMA, which the breaker never counts; the others sample."""
    tokenizer = load_tokenizer(default_model_path)
    assert tokenizer is not None
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, [2])
    broken = ResponseFormat("json_schema", '{"$ref": "#"}')
    with pytest.raises(KvmeshError) as refused:
        compiler.matcher(broken)  # refused where it is compiled, before any request runs it
    assert refused.value.reason is Reason.INVALID_SCHEMA and "no output" in refused.value.message
    params = SamplingParams(max_tokens=4, temperature=0.0)
    states = [RequestState(f"r{i}", [1, 2], [0], 1, params, 2) for i in range(3)]
    states[0].matcher = llguidance.LLMatcher(compiler.tokenizer, grammar_of(broken))
    outcomes = sample(torch.randn(3, tokenizer.vocab_size), states, torch.Generator())
    assert isinstance(outcomes[0], FailedRequest)
    assert (outcomes[0].reason, outcomes[0].error_type) == ("INVALID_SCHEMA", "GrammarFailed")
    assert all(isinstance(o, SampledToken) for o in outcomes[1:])


def failed(count: int, reason: str = "EXECUTION_FAILED") -> list[FailedRequest]:
    return [FailedRequest(f"r{i}", reason, "RuntimeError") for i in range(count)]


def test_the_circuit_breaker_trips_on_failures_within_its_window() -> None:
    breaker = CircuitBreaker(max_failures=3, window_s=10.0, cooldown_s=5.0)
    assert not breaker.record(failed(2), 0, now=0.0)
    assert not breaker.record(failed(1), 0, now=11.0)  # the first two fell out of the window
    assert not breaker.record(failed(1), 0, now=12.0)
    assert breaker.record(failed(1), 0, now=13.0)  # three within 10 s
    assert breaker.open_until == 18.0
    assert not breaker.record(failed(5), 0, now=14.0)  # open already: no second trip
    assert not CircuitBreaker(max_failures=0).record(failed(100), 0)  # 0: off


def test_the_breaker_counts_only_what_says_something_of_the_worker() -> None:
    breaker = CircuitBreaker(max_failures=3, window_s=10.0, cooldown_s=5.0)
    # A request's own parameters, however many: never counted.
    assert not breaker.record(failed(50, "INVALID_SAMPLING_PARAMS"), 0, now=0.0)
    # Failures beside a request that sampled: the worker computes; nothing counted.
    assert not breaker.record(failed(5), 1, now=1.0)
    assert not breaker.record(failed(2), 0, now=2.0)
    assert not breaker.record([], 4, now=3.0)  # a token sampled: the count starts over
    assert not breaker.record(failed(2), 0, now=4.0)
    assert breaker.record(failed(1), 0, now=5.0)  # three in a row, nothing sampled between


def test_fault_injector_spec() -> None:
    assert FaultInjector.parse(None) is None and FaultInjector.parse("") is None
    assert FaultInjector.parse("42") == FaultInjector((FaultRule(42, 1),))
    assert FaultInjector.parse("42:3") == FaultInjector((FaultRule(42, 3),))
    faults = FaultInjector.parse("42:1,7:2:worker")
    assert faults is not None
    assert faults.rules == (FaultRule(42, 1), FaultRule(7, 2, breaks_worker=True))
    with pytest.raises(InjectedFault):
        faults.check([42], 1)
    faults.check([1, 2], 5)  # another request: the first rule fails only its own
    faults.check([7], 1)  # not yet
    with pytest.raises(InjectedFault):
        faults.check([7], 2)
    with pytest.raises(InjectedFault, match="broken"):
        faults.check([1, 2], 5)  # every request from then on

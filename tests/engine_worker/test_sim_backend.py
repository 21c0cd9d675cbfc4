"""`--backend sim`: no model computed, each token drawn from the request's seed, position and
previous token, a step slept to its set time. Its tokens are the same alone or batched, per
seed; the request's own limits, stop ids, response format and logprobs hold as on a real
backend; it says what it is and is never chosen by `auto`."""

from __future__ import annotations

import re
import time

import pytest

from kvmesh.engine import Engine
from services.engine_worker.backends import resolve_backend
from shared.config import EngineConfig, SchedulerConfig, SimConfig
from shared.sampling import ResponseFormat, SamplingParams

PROMPTS = ["Why is the sky blue?", "Name three rivers.", "hi"]


def sim_engine(step_ms: float = 0.0, **overrides: object) -> Engine:
    config = EngineConfig(backend="sim", sim=SimConfig(step_ms=step_ms), **overrides)  # type: ignore[arg-type]
    return Engine(config)


@pytest.fixture(scope="module")
def engine(default_model_path: str) -> Engine:
    return sim_engine()


def test_its_tokens_are_the_same_alone_or_batched_and_follow_the_seed(engine: Engine) -> None:
    def params(seed: int | None) -> SamplingParams:  # unseeded: greedy
        temperature = 0.8 if seed is not None else 0.0
        return SamplingParams(max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True)

    together = engine.generate(PROMPTS, [params(7), params(7), params(None)])
    alone = [engine.generate([p], params(s))[0] for p, s in zip(PROMPTS, (7, 7, None), strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) == 12 for c in together)
    reseeded = engine.generate(PROMPTS[:1], params(8))[0]
    assert reseeded.token_ids != together[0].token_ids
    sampled = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    first, second = engine.generate(PROMPTS[:1] * 2, sampled)  # unseeded: each its own draw
    assert first.token_ids != second.token_ids
    one_row = sim_engine(scheduler=SchedulerConfig(max_num_seqs=1))
    assert [c.token_ids for c in one_row.generate(PROMPTS, params(7))][:2] == [
        c.token_ids for c in together[:2]
    ]


def test_limits_stop_ids_formats_and_logprobs_hold(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = engine.generate(PROMPTS[:1], greedy)[0]
    stop_at = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first.token_ids[2]])
    stopped = engine.generate(PROMPTS[:1], stop_at)[0]
    assert stopped.token_ids == first.token_ids[:3] and stopped.finish_reason == "stop"
    scored = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4, logprobs=3))[0]
    assert all(
        len(entry.top) == 3 and entry.top[0][0] == entry.token_id for entry in scored.logprobs
    )
    digits = SamplingParams(max_tokens=8, response_format=ResponseFormat("regex", "[0-9]{3}"))
    formatted = engine.generate(PROMPTS[:1], digits)[0]
    assert re.fullmatch("[0-9]{3}", formatted.text), formatted.text


def test_a_step_sleeps_to_its_time_without_spinning(default_model_path: str) -> None:
    slow = sim_engine(step_ms=20.0)
    wall, cpu = time.perf_counter(), time.process_time()
    slow.generate(PROMPTS[:1], SamplingParams(max_tokens=10, ignore_eos=True))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 10 * 0.020  # one prefill step and nine decode steps at least
    assert cpu < wall / 2  # waited, not spun


def test_it_says_what_it_is_and_auto_never_picks_it(engine: Engine) -> None:
    assert engine.manifest["backend"] == "sim"
    assert engine.manifest["device"].startswith("simulated")
    assert resolve_backend("auto") != "sim"
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1)  # no distribution to score with
    refused = engine.generate(PROMPTS[:1], scored)[0]
    assert refused.error is not None and not refused.token_ids

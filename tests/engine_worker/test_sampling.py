"""Sampling on the real default model: seeds, top-k, logprobs, stops, penalties."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvmesh.engine import Engine
from services.engine_worker.sampler import _apply_penalties, sample
from services.engine_worker.step_inputs import RequestState
from shared.config import CacheConfig, EngineConfig
from shared.sampling import SamplingParams

PROMPT = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}]}


@pytest.fixture(scope="module")
def engine(default_model_path: str) -> Engine:
    return Engine(
        EngineConfig(model=default_model_path, cache=CacheConfig(kv_memory_bytes=128 << 20))
    )


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine: Engine) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=0.9, seed=None)
    batch = engine.generate(
        ["Tell me a joke.", PROMPT, "List three colours."], [others, seeded, others]
    )
    assert batch[1].token_ids == alone
    different_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=99)
    assert engine.generate([PROMPT], different_seed)[0].token_ids != alone


def test_top_k_one_is_greedy(engine: Engine) -> None:
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0))[0]
    top1 = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.5, top_k=1))[0]
    assert top1.token_ids == greedy.token_ids


def test_logprobs_report_the_sampled_token_and_sorted_alternatives(engine: Engine) -> None:
    result = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, logprobs=4))[0]
    assert len(result.logprobs) == len(result.token_ids) == 6
    for token_id, entry in zip(result.token_ids, result.logprobs, strict=True):
        assert entry.token_id == token_id
        values = [v for _, v in entry.top]
        assert len(entry.top) == 4 and values == sorted(values, reverse=True)
        assert entry.top[0][0] == token_id  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(values[0]) and entry.logprob <= 0.0


def test_stop_token_and_max_tokens_end_with_their_reasons(engine: Engine) -> None:
    free = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_at = free.token_ids[3]
    stopped = engine.generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]


def test_answer_ends_at_eos_unless_ignored(engine: Engine) -> None:
    short = {"messages": [{"role": "user", "content": "Say only the word yes."}]}
    ended = engine.generate([short], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert ended.finish_reason == "stop" and ended.token_ids[-1] == 2
    ignored = engine.generate(
        [short],
        SamplingParams(max_tokens=len(ended.token_ids) + 3, temperature=0.0, ignore_eos=True),
    )[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(ended.token_ids) + 3


def test_preemption_under_a_tight_kv_budget_gives_identical_greedy_output(
    default_model_path: str, engine: Engine
) -> None:
    prompts = [f"Count from {i} to {i + 20}, separated by commas." for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = engine.generate(prompts, params)
    block_bytes = engine.worker.manifest.kv_bytes_per_token * 16
    tight = Engine(
        EngineConfig(model=default_model_path, cache=CacheConfig(kv_memory_bytes=14 * block_bytes))
    )
    squeezed = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [c.token_ids for c in squeezed] == [c.token_ids for c in roomy]
    assert tight.scheduler.load().num_free_blocks == tight.scheduler.load().num_blocks


def test_abort_mid_stream_returns_every_block(engine: Engine) -> None:
    stream = engine.stream(PROMPT, SamplingParams(max_tokens=50, temperature=0.0))
    assert next(stream)
    stream.close()  # the caller walks away: the request is aborted
    load = engine.scheduler.load()
    assert load.num_running == load.num_waiting == 0
    assert load.num_free_blocks == load.num_blocks


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = _apply_penalties(logits.clone(), [0, 1, 2, 2], prompt_len=2, params=params)
    # token 0, 1: prompt only -> repetition only; token 2: output twice -> all three.
    assert out.tolist() == pytest.approx([1.0, -4.0, 0.5 - 0.5 - 0.5, 0.5])


def test_min_p_and_top_p_keep_only_the_head_of_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.08, 0.02]]))
    rng = torch.Generator().manual_seed(0)
    for params in (
        SamplingParams(temperature=1.0, min_p=0.4),
        SamplingParams(temperature=1.0, top_p=0.5),
    ):
        state = RequestState("r", [0], [], 0, params, 1)
        draws = {sample(logits, [state], rng)[0].token_id for _ in range(200)}
        assert draws <= {0, 1} and 0 in draws


def test_top_p_keeps_or_drops_tied_tokens_together() -> None:
    """Mass strictly above a token decides, as the GPU sampler's threshold: two tokens of 0.3
    after one of 0.4 are both kept at top_p 0.5, whichever the sort puts first."""
    logits = torch.log(torch.tensor([[0.3, 0.4, 0.3, 0.0001]]))
    rng = torch.Generator().manual_seed(0)
    state = RequestState("r", [0], [], 0, SamplingParams(temperature=1.0, top_p=0.5), 1)
    draws = {sample(logits, [state], rng)[0].token_id for _ in range(300)}
    assert draws == {0, 1, 2}


def test_logit_bias_forces_or_bans_a_token_and_leaves_logprobs_alone(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    free = engine.generate([PROMPT], greedy)[0]
    first = free.token_ids[0]
    banned = engine.generate([PROMPT], replace(greedy, logit_bias=((first, -100.0),)))[0]
    assert banned.token_ids[0] != first
    forced_token = 1234
    forced = engine.generate([PROMPT], replace(greedy, logit_bias=((forced_token, 100.0),)))[0]
    assert forced.token_ids == [forced_token] * 4
    # Logprobs are the model's own: the forced token is unlikely under it.
    assert forced.logprobs[0].logprob < free.logprobs[0].logprob
    sampled = SamplingParams(max_tokens=4, temperature=1.0, seed=3, logit_bias=((77, 100.0),))
    assert engine.generate([PROMPT], sampled)[0].token_ids == [77] * 4

"""Prompt logprobs (echo for evaluation harnesses) equal transformers' on the same float32
weights, across prefill chunks, and are not lost to a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.errors import KvmeshError
from shared.sampling import SamplingParams

TOLERANCE = 1e-3  # nats per token
PROMPT = [1, *range(2000, 2060)]  # 61 tokens: four chunks of 16


@pytest.fixture(scope="module")
def reference(hf_default_model) -> torch.Tensor:
    """transformers' log-distribution after each prefix of PROMPT."""
    with torch.inference_mode():
        logits = hf_default_model(torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def engine(default_model_path: str) -> Engine:
    return Engine(
        EngineConfig(
            model=default_model_path,
            weights="float32",
            cache=CacheConfig(kv_memory_bytes=64 << 20),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=64, max_num_seqs=4, prefill_chunk_size=16
            ),
        )
    )


def check_against(reference: torch.Tensor, entries, top: int) -> None:
    assert [e.token_id for e in entries] == PROMPT[1:]
    for position, entry in enumerate(entries):
        expected = float(reference[position, PROMPT[position + 1]])
        assert abs(entry.logprob - expected) < TOLERANCE, position
        assert len(entry.top) == top
        if top:
            best = float(reference[position].max())
            assert abs(entry.top[0][1] - best) < TOLERANCE, position


def test_prompt_logprobs_over_chunks_equal_transformers(engine: Engine, reference) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    (completion,) = engine.generate([PROMPT], params)
    check_against(reference, completion.prompt_logprobs, top=2)
    assert len(completion.token_ids) == 1


def test_a_cached_prompt_is_scored_whole(engine: Engine, reference) -> None:
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([PROMPT], plain)  # its full blocks now sit in the prefix cache
    (again,) = engine.generate([PROMPT], plain)
    assert again.cached_tokens >= 48 and not again.prompt_logprobs
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (completion,) = engine.generate([PROMPT], scored)
    assert completion.cached_tokens == 0  # it computed every position, to score it
    check_against(reference, completion.prompt_logprobs, top=0)
    load = engine.scheduler.load()
    assert load.num_free_blocks == load.num_blocks


def test_batched_with_other_requests_each_scores_its_own(engine: Engine, reference) -> None:
    scored = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    other = [5, *range(3000, 3030)]
    results = engine.generate([other, PROMPT, other], [plain, scored, scored])
    assert not results[0].prompt_logprobs
    check_against(reference, results[1].prompt_logprobs, top=1)
    assert [e.token_id for e in results[2].prompt_logprobs] == other[1:]


def test_out_of_range_is_refused() -> None:
    with pytest.raises(KvmeshError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()

"""Speculative decoding in the engine: greedy output with drafts is token for token the output
without them (default model, random Llama/Qwen2 checkpoints; batched, chunked and cached), a
sampled request's token distribution is unchanged (chi-square), and drafts work beside response
formats, logprobs and seeds.

One loaded worker per model serves every configuration: only the scheduler (where drafts are
proposed) differs, and it is replaced between runs, with the worker holding no request."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator

import pytest

from kvmesh.engine import Completion, Engine
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from shared.sampling import ResponseFormat, SamplingParams

COPY_PROMPT = (
    "Repeat this list exactly, one item per line:\napples\npears\nplums\ncherries\n"
    "apples\npears\nplums\ncherries\napples\npears\n"
)
# Four sequences at a time, 16-token chunks: prompts arrive over several steps, prefill chunks
# share steps with decodes and their drafts.
BATCHING = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, prefill_chunk_size=16)


def load(model: str | None, prefix: bool = True, **overrides: object) -> Engine:
    cache = CacheConfig(kv_memory_bytes=64 << 20, enable_prefix_caching=prefix)
    return Engine(EngineConfig(model=model, cache=cache, scheduler=BATCHING, **overrides))  # type: ignore[arg-type]


def speculating(engine: Engine, method: str, **options: object) -> Engine:
    """The engine with a fresh scheduler that drafts by `method` (its worker as loaded)."""
    assert not engine.scheduler.has_unfinished()
    engine.worker.requests.clear()  # the finished ones the old scheduler had yet to drop
    config = dataclasses.replace(
        engine.config.scheduler,
        speculative=SpeculativeConfig(method, **options),  # type: ignore[arg-type]
    )
    worker = engine.worker
    engine.scheduler = Scheduler(
        config,
        engine.config.cache,
        worker.num_kv_blocks,
        worker.max_model_len,
        worker.architecture.eos_token_ids,
    )
    return engine


def run(engine: Engine, prompts: list, params: SamplingParams | list) -> list[Completion]:
    completions = engine.generate(prompts, params)
    assert all(c.error is None for c in completions)
    assert engine.scheduler.block_manager.num_free_blocks == engine.worker.num_kv_blocks
    return completions


@pytest.fixture(scope="module")
def default_engine(default_model_path: str) -> Iterator[Engine]:
    yield load(None)


def test_default_model_greedy_output_is_the_same_with_drafts(default_engine: Engine) -> None:
    assert default_engine.tokenizer is not None
    copy = default_engine.tokenizer.encode(COPY_PROMPT)
    prompts = [copy, copy[:20] + copy, "The capital of France is", copy[5:]]  # shared prefixes
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
    plain = run(speculating(default_engine, "off"), prompts, params)
    for method in ("ngram", "suffix"):
        drafted = run(speculating(default_engine, method), prompts, params)
        assert [c.token_ids for c in drafted] == [c.token_ids for c in plain], method
        # Logprobs too: each token's row is computed as the same decode row alone would be.
        assert [[lp.top for lp in c.logprobs] for c in drafted] == [
            [lp.top for lp in c.logprobs] for c in plain
        ]
        speculator = default_engine.scheduler.speculator
        assert speculator.num_accepted_drafts > 20, method  # it did speculate, and it paid


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("prefix", [True, False])
def test_random_checkpoints_greedy_output_is_the_same_with_drafts(
    checkpoint: str, prefix: bool, request: pytest.FixtureRequest
) -> None:
    engine = load(request.getfixturevalue(checkpoint), prefix, weights="float32")
    rng = random.Random(3)
    motif = [rng.randrange(3, 500) for _ in range(12)]
    prompts = [motif * 3, motif * 2 + motif[:5], [rng.randrange(3, 500) for _ in range(40)]]
    prompts += [motif * 3 + [7]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = run(engine, prompts, params)
    # Unigram matches and no cost bar: random weights seldom repeat longer runs of the context.
    drafted = run(speculating(engine, "ngram", ngram_min=1, draft_row_cost=0.0), prompts, params)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain]
    assert engine.scheduler.speculator.num_draft_tokens > 20  # verified, mostly rolled back


def test_sampled_token_distribution_is_unchanged_by_drafts(tiny_llama_dir: str) -> None:
    """Temperature 1.0, 2,000 seeds: the distribution of the tokens verified against drafts
    (the 2nd and 3rd output tokens) with and without speculation agree (chi-square)."""
    favoured = (11, 12, 13)  # a bias makes each draft likely but not certain
    prompt = [11] * 18  # drafts of 11, which the model then favours but does not always pick
    bias = tuple((token, 10.0) for token in favoured)
    seeds = [
        SamplingParams(max_tokens=3, temperature=1.0, seed=s, logit_bias=bias, ignore_eos=True)
        for s in range(2000)
    ]
    engine = Engine(
        EngineConfig(
            model=tiny_llama_dir,
            cache=CacheConfig(kv_memory_bytes=64 << 20),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=256),
        )
    )
    counts = {}
    for method in ("off", "ngram"):
        speculating(engine, method, max_draft_tokens=2, ngram_min=1, draft_row_cost=0.0)
        completions = run(engine, [prompt] * len(seeds), seeds)
        counts[method] = [
            _histogram([c.token_ids[i] for c in completions], favoured) for i in (1, 2)
        ]
    speculator = engine.scheduler.speculator
    rejected = speculator.num_draft_tokens - speculator.num_accepted_drafts
    assert speculator.num_accepted_drafts > 50 and rejected > 50  # both rules ran
    for with_drafts, without in zip(counts["ngram"], counts["off"], strict=True):
        assert _chi_square(with_drafts, without) < 16.27  # 3 degrees of freedom, p = 0.001


def _histogram(tokens: list[int], favoured: tuple[int, ...]) -> list[int]:
    return [tokens.count(t) for t in favoured] + [sum(t not in favoured for t in tokens)]


def _chi_square(a: list[int], b: list[int]) -> float:
    """Two-sample homogeneity statistic over the categories either sample has."""
    total_a, total_b = sum(a), sum(b)
    statistic = 0.0
    for x, y in zip(a, b, strict=True):
        if x + y == 0:
            continue
        expected_a = (x + y) * total_a / (total_a + total_b)
        expected_b = (x + y) * total_b / (total_a + total_b)
        statistic += (x - expected_a) ** 2 / expected_a + (y - expected_b) ** 2 / expected_b
    return statistic


def test_drafts_beside_a_response_format_a_seed_and_an_opt_out(default_engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string"}}},
        "required": ["items"],
    }
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    structured = SamplingParams(max_tokens=60, temperature=0.0, response_format=fmt)
    # Cool enough to copy the list (drafts match) whatever the packed kernel's rounding.
    seeded = SamplingParams(max_tokens=30, temperature=0.1, seed=42)
    plain = run(speculating(default_engine, "off"), [COPY_PROMPT], structured)[0]
    plain_seeded = run(default_engine, [COPY_PROMPT], seeded)[0]
    engine = speculating(default_engine, "ngram", draft_row_cost=0.0)
    drafted = run(engine, [COPY_PROMPT], structured)[0]
    assert drafted.token_ids == plain.token_ids
    json.loads(drafted.text)  # the format held with drafts proposed from a free-text prompt
    again = [run(engine, [COPY_PROMPT], seeded)[0].token_ids for _ in range(2)]
    assert again[0] == again[1]  # a seeded request stays reproducible with drafts
    assert engine.scheduler.speculator.num_draft_tokens > 0
    # Opted out: no drafts, and the seeded sample a server without speculation gives.
    before = engine.scheduler.speculator.num_draft_tokens
    opted_out = dataclasses.replace(seeded, disable_speculation=True)
    assert run(engine, [COPY_PROMPT], opted_out)[0].token_ids == plain_seeded.token_ids
    assert engine.scheduler.speculator.num_draft_tokens == before


def test_n_completions_fork_and_draft_each(default_engine: Engine) -> None:
    """n = 3 of one prompt: the forks draft each on their own; greedy, all three give the
    answer the request alone gives without drafts, and every block comes back."""
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    alone = run(speculating(default_engine, "off"), [COPY_PROMPT], greedy)[0].token_ids
    engine = speculating(default_engine, "ngram", draft_row_cost=0.0)
    ids = [engine.add_request(COPY_PROMPT, greedy, group_id="fork") for _ in range(3)]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert all(tokens[request_id] == alone for request_id in ids)
    assert engine.scheduler.speculator.num_accepted_drafts > 0
    assert engine.scheduler.block_manager.stats.forked > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.worker.num_kv_blocks

"""Greedy output equals transformers token for token on the same weights (fp32), with batching,
chunked prefill and prefix caching on and off; 16 prompts of mixed lengths submitted at once,
some sharing long prefixes."""

from __future__ import annotations

import random

import pytest

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.engine_worker.parity import TOP, Greedy, compare, hf_model, transformers_greedy

CONFIGS = [  # (prefill chunk, prefix caching)
    pytest.param(16, True, id="chunk16-prefix"),
    pytest.param(16, False, id="chunk16-noprefix"),
    pytest.param(None, True, id="nochunk-prefix"),
    pytest.param(None, False, id="nochunk-noprefix"),
]


def mixed_prompts(vocab_low: int, vocab_high: int, seed: int = 7) -> list[list[int]]:
    """16 prompts, 1 to ~200 tokens; two families share 96- and 150-token prefixes."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_low, vocab_high) for _ in range(n)]

    family_a, family_b = tokens(96), tokens(150)
    prompts = [tokens(n) for n in (1, 5, 16, 17, 33, 64, 120, 200)]
    prompts += [family_a + tokens(n) for n in (3, 10, 40, 0)]
    prompts += [family_b + tokens(n) for n in (1, 20, 49, 7)]
    return prompts


def run_kvmesh(
    model: str, prompts: list[list[int]], max_new: int, chunk: int | None, prefix: bool
) -> tuple[list[Greedy], Engine, int]:
    # Four sequences at a time: prompts are admitted over many steps, so later ones hit the
    # prefix cache, and prefill chunks share steps with decodes. A sliding-window model's
    # sliding layers keep their window only (no prefix to reuse) unless they keep it all.
    cache = CacheConfig(
        kv_memory_bytes=64 << 20,
        enable_prefix_caching=prefix,
        sliding_window_kv="full" if prefix else "window",
    )
    engine = Engine(
        EngineConfig(
            model=model,
            weights="float32",  # transformers' own arithmetic on the dequantized weights
            cache=cache,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=256, max_num_seqs=4, prefill_chunk_size=chunk
            ),
        )
    )
    largest_batch = 0
    execute = engine.worker.execute

    def counting_execute(plan):  # type: ignore[no-untyped-def]
        nonlocal largest_batch
        largest_batch = max(largest_batch, len(plan.new_requests) + len(plan.running_requests))
        return execute(plan)

    engine.worker.execute = counting_execute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=TOP)
    completions = engine.generate(prompts, params)
    greedy = [
        Greedy(c.token_ids, [[t for t, _ in lp.top] for lp in c.logprobs]) for c in completions
    ]
    return greedy, engine, largest_batch


def check_parity(ours: list[Greedy], reference: list[Greedy]) -> None:
    verdicts = [compare(o, r) for o, r in zip(ours, reference, strict=True)]
    bad = [v for v in verdicts if v not in ("match", "near_tie")]
    assert not bad, verdicts
    assert verdicts.count("match") >= 15, verdicts


def check_engine_state(engine: Engine, prefix: bool, largest_batch: int) -> None:
    load = engine.scheduler.load()
    assert load.num_waiting == load.num_running == 0
    assert load.num_free_blocks == load.num_blocks  # every block came back
    assert largest_batch > 1
    assert (load.prefix_hit_tokens > 0) == prefix
    window = engine.worker.window_blocks
    sliding = bool(engine.worker.architecture.style.sliding_layers)
    assert (window is not None) == (sliding and not prefix)
    if window is not None:  # used, and every window block free or held by a request still
        assert engine.manifest["sliding_window"] > 0  # on the worker (until the next plan)
        states = engine.worker.requests.values()
        held = sum(len([b for b in s.window_ids if b]) for s in states)
        assert window.num_free + held == window.num_blocks - 1


@pytest.fixture(scope="module")
def default_reference(hf_default_model) -> tuple[list[list[int]], list[Greedy]]:
    prompts = mixed_prompts(100, 49000)
    return prompts, transformers_greedy(hf_default_model, prompts, 16, eos=2)


@pytest.mark.parametrize("chunk, prefix", CONFIGS)
def test_default_model_matches_transformers(
    default_model_path: str, default_reference, chunk, prefix
) -> None:
    prompts, reference = default_reference
    ours, engine, largest = run_kvmesh(default_model_path, prompts, 16, chunk, prefix)
    check_parity(ours, reference)
    check_engine_state(engine, prefix, largest)


@pytest.fixture(
    scope="module",
    params=[
        "tiny_llama_dir",
        "tiny_qwen2_dir",
        "tiny_qwen3_dir",
        "tiny_phi3_dir",
        "tiny_mistral_dir",
        "tiny_gemma2_dir",
        "tiny_gemma3_dir",
        "tiny_phi4_mini_dir",
    ],
)
def random_reference(request) -> tuple[str, list[list[int]], list[Greedy]]:
    path = request.getfixturevalue(request.param)
    prompts = mixed_prompts(3, 512)
    return path, prompts, transformers_greedy(hf_model(path), prompts, 24, eos=2)


@pytest.mark.parametrize("chunk, prefix", CONFIGS)
def test_random_checkpoints_match_transformers(random_reference, chunk, prefix) -> None:
    path, prompts, reference = random_reference
    ours, engine, largest = run_kvmesh(path, prompts, 24, chunk, prefix)
    check_parity(ours, reference)
    check_engine_state(engine, prefix, largest)

"""n completions of one prompt on the real default model: forked K/V gives the same tokens as
each completion run alone, the prompt's blocks are held once, and aborting frees all of it."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig
from shared.sampling import SamplingParams

# 37 tokens with the chat template: two full blocks of 16 and a partial one to copy.
PROMPT = {"messages": [{"role": "user", "content": "Name a colour, then say why you like it."}]}
N = 4


@pytest.fixture(scope="module")
def engine(default_model_path: str) -> Engine:
    return Engine(
        EngineConfig(model=default_model_path, cache=CacheConfig(kv_memory_bytes=64 << 20))
    )


def run_group(engine: Engine, params: SamplingParams, group: str) -> list[list[int]]:
    ids = [
        engine.add_request(
            PROMPT,
            dataclasses.replace(params, seed=None if params.seed is None else params.seed + i),
            request_id=f"{group}/{i}",
            group_id=group,
        )
        for i in range(N)
    ]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[request_id] for request_id in ids]


def test_seeded_forks_equal_each_completion_sent_alone(engine: Engine) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=77, ignore_eos=True)
    forked = run_group(engine, params, "seeded")
    alone = [
        engine.generate([PROMPT], dataclasses.replace(params, seed=77 + i))[0].token_ids
        for i in range(N)
    ]
    assert forked == alone
    assert len({tuple(tokens) for tokens in forked}) > 1  # the seeds did make them differ
    assert engine.scheduler.block_manager.stats.forked > 0


def test_greedy_forks_equal_one_greedy_run(engine: Engine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    greedy = engine.generate([PROMPT], params)[0].token_ids
    assert run_group(engine, params, "greedy") == [greedy] * N


def test_the_prompt_blocks_are_held_once_and_an_abort_frees_them(engine: Engine) -> None:
    manager = engine.scheduler.block_manager
    params = SamplingParams(max_tokens=50, temperature=0.8, seed=5, ignore_eos=True)
    ids = [
        engine.add_request(PROMPT, params, request_id=f"held/{i}", group_id="held")
        for i in range(N)
    ]
    while any(engine.scheduler.requests[i].num_output_tokens < 2 for i in ids):
        engine.step()
    members = [engine.scheduler.requests[i] for i in ids]
    prompt_len = members[0].prompt_len
    full_blocks = (prompt_len - 1) // manager.block_size
    assert full_blocks >= 2
    shared = members[0].block_ids[:full_blocks]
    assert all(m.block_ids[:full_blocks] == shared for m in members)
    assert all(manager.blocks[b].ref_count == N for b in shared)
    held = {b for m in members for b in m.block_ids}
    assert manager.num_blocks - manager.num_free_blocks == len(held)
    assert len(held) == full_blocks + sum(len(m.block_ids) - full_blocks for m in members)
    for request_id in ids:  # the client walked away mid-stream
        engine.abort(request_id)
    assert manager.num_free_blocks == manager.num_blocks
    assert not engine.scheduler.requests

"""KV tier faults through the real loader, scheduler and worker (in process): whatever goes
wrong below the pool, every request completes with the tokens it would have had, the counters
say what happened, and every KV block comes back.

A recomputed stretch of prompt runs in a differently cut prefill than the reference's, which
the eager float32 step does not make bit-exact: tokens are compared exactly, logprobs to 1e-4
(a load that succeeds gives exact bits: tests/e2e/test_mesh_kv_tiers.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvmesh.engine import Completion, Engine
from shared.config import CacheConfig, EngineConfig, KVTierConfig
from shared.sampling import SamplingParams

DOCUMENT = [(7 * i + 3) % 250 + 1 for i in range(96)]  # 6 full blocks of 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


def engine(model: str, tiers: KVTierConfig, dtype: str = "float32") -> Engine:
    cache = CacheConfig(kv_memory_bytes=16 << 20)
    return Engine(EngineConfig(model=model, dtype=dtype, cache=cache, kv_tiers=tiers))


def answer(completion: Completion) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for lp in completion.logprobs]


def same_answer(found: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    return [t for t, _ in found] == [t for t, _ in expected] and all(
        abs(a - b) < 1e-4 for (_, a), (_, b) in zip(found, expected, strict=True)
    )


def ask(engine: Engine, question: int) -> Completion:
    (completion,) = engine.generate([[*DOCUMENT, question, question + 1]], GREEDY)
    assert completion.finish_reason == "length", completion.error
    return completion


def assert_no_block_held(engine: Engine) -> None:
    manager = engine.scheduler.block_manager
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture
def expected(tiny_llama_dir: str) -> Callable[[int], list[tuple[int, float]]]:
    """What a question's answer is when its prompt is computed in a pool that holds its
    document (as a loaded one does)."""
    reference = engine(tiny_llama_dir, KVTierConfig())

    def answer_to(question: int) -> list[tuple[int, float]]:
        ask(reference, 1)  # the document in the pool, as every case below has it
        return answer(ask(reference, question))

    return answer_to


def test_a_flipped_byte_on_disk_is_recomputed(tiny_llama_dir, tmp_path, expected) -> None:
    tiers = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path), load_min_tokens=16)
    writer = engine(tiny_llama_dir, tiers)
    ask(writer, 1)
    writer.worker.kv_transfer.store.flush()  # type: ignore[union-attr]
    victim = sorted(tmp_path.glob("*.kvb"), key=lambda p: p.stat().st_mtime)[2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    restarted = engine(tiny_llama_dir, tiers)
    completion = ask(restarted, 5)
    assert same_answer(answer(completion), expected(5))
    assert completion.loaded_tokens == 32  # the two blocks before the bad one
    store = restarted.worker.kv_transfer.store
    assert store is not None and store.stats.failed_loads == {"disk:checksum": 1}
    assert restarted.scheduler.tier_loads.stats.short_loads == 1
    assert_no_block_held(restarted)


def test_redis_killed_mid_run_recomputes(tiny_llama_dir, redis_server, expected) -> None:
    tiers = KVTierConfig(tiers=("redis",), redis_url=redis_server.url, load_min_tokens=16)
    writer, reader = engine(tiny_llama_dir, tiers), engine(tiny_llama_dir, tiers)
    ask(writer, 1)
    writer.worker.kv_transfer.store.flush()  # type: ignore[union-attr]
    # The reader's lookup finds the blocks; Redis dies before the step that loads them (with
    # no prefetch, which would have staged them by then: tested in test_kv_tier_store.py).
    store = reader.worker.kv_transfer.store
    assert store is not None
    store.prefetcher = None
    reader.add_request([*DOCUMENT, 5, 6], GREEDY, request_id="after-redis")
    assert reader.scheduler.requests["after-redis"].num_tier_blocks == 6
    redis_server.stop()
    outputs = []
    while reader.has_unfinished():
        outputs += reader.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    logprobs = [(lp.token_id, lp.logprob) for o in outputs for lp in o.logprobs]
    assert same_answer(logprobs, expected(5)) and len(tokens) == 6
    assert store.stats.failed_loads["redis:unavailable"] == 1
    assert reader.scheduler.tier_loads.stats.short_loads == 1
    assert_no_block_held(reader)


def test_a_full_disk_budget_loads_what_is_left(tiny_llama_dir, tmp_path, expected) -> None:
    # Room for two blocks: the prefix's first ones are evicted by its later ones, so the
    # lookup finds nothing to load from the start and the prompt is computed.
    block_bytes = engine(tiny_llama_dir, KVTierConfig()).worker.runner.kv_pool.block_payload_bytes
    record_bytes = block_bytes + 4 * 16 + 20  # its tokens and header beside it
    tiers = KVTierConfig(
        tiers=("disk",), disk_dir=str(tmp_path), disk_bytes=2 * record_bytes, load_min_tokens=16
    )
    writer = engine(tiny_llama_dir, tiers)
    ask(writer, 1)
    writer.worker.kv_transfer.store.flush()  # type: ignore[union-attr]
    assert len(list(tmp_path.glob("*.kvb"))) == 2
    reader = engine(tiny_llama_dir, tiers)
    completion = ask(reader, 5)
    assert same_answer(answer(completion), expected(5)) and completion.loaded_tokens == 0
    assert_no_block_held(reader)


def test_blocks_of_another_kv_dtype_are_not_loaded(tiny_llama_dir, tmp_path) -> None:
    tiers = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path), load_min_tokens=16)
    writer = engine(tiny_llama_dir, tiers)
    ask(writer, 1)
    writer.worker.kv_transfer.store.flush()  # type: ignore[union-attr]
    other = engine(tiny_llama_dir, tiers, dtype="bfloat16")  # its pool holds bfloat16
    completion = ask(other, 5)
    assert completion.loaded_tokens == 0
    same = engine(tiny_llama_dir, tiers)
    assert ask(same, 5).loaded_tokens == len(DOCUMENT)  # the writer's own kind loads


def test_a_pool_that_refuses_a_loaded_block_recomputes_the_rest(
    tiny_llama_dir, tmp_path, expected, monkeypatch
) -> None:
    tiers = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path), load_min_tokens=16)
    writer = engine(tiny_llama_dir, tiers)
    ask(writer, 1)
    reader = engine(tiny_llama_dir, tiers)
    pool = reader.worker.kv_transfer.pool
    write_block, calls = pool.write_block, []

    def failing_third(block_id: int, payload: bytes) -> None:
        calls.append(block_id)
        if len(calls) == 3:
            raise RuntimeError("device refused the copy")
        write_block(block_id, payload)

    monkeypatch.setattr(pool, "write_block", failing_third)
    completion = ask(reader, 5)
    assert same_answer(answer(completion), expected(5)) and completion.loaded_tokens == 32
    assert reader.scheduler.tier_loads.stats.short_loads == 1
    assert_no_block_held(reader)

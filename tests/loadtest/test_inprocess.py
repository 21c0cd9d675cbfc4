"""The in-process peers, timed like the network targets: the Engine as a load target (a
thread steps it while the driver awaits), and transformers in static batches."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvmesh.engine import Engine
from loadtest.driver import LoadShape, run_load
from loadtest.inprocess import EngineTarget, run_transformers
from loadtest.workload import RequestSpec
from shared.config import CacheConfig, EngineConfig

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def specs(count: int) -> list[RequestSpec]:
    return [
        RequestSpec(i, [5 + i, 17, 42, 99, 7][: 3 + i % 3], 4 + i % 3, dict(GREEDY))
        for i in range(count)
    ]


def test_engine_target_under_closed_and_open_loop(tiny_llama_dir: str) -> None:
    engine = Engine(EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_memory_bytes=16 << 20)))

    async def both() -> tuple:
        async with EngineTarget(engine) as target:
            closed = await run_load(target, specs(6), LoadShape(concurrency=3), progress=False)
            opened = await run_load(target, specs(6), LoadShape(rate=50.0), progress=False)
        return closed, opened

    for result in asyncio.run(both()):
        for record, spec in zip(result.records, specs(6), strict=True):
            assert record.outcome == "completed" and record.output_tokens == spec.max_tokens
            assert 0 < record.ttft_s <= record.e2e_s and len(record.itl_s) == spec.max_tokens - 1
    assert not engine.has_unfinished()


def test_transformers_static_batches_time_each_request(tiny_llama_dir: str) -> None:
    result = run_transformers(tiny_llama_dir, specs(5), concurrency=2, threads=1)
    assert [r.output_tokens for r in result.records] == [s.max_tokens for s in specs(5)]
    for record in result.records:
        assert 0 < record.ttft_s < record.e2e_s and len(record.itl_s) == record.output_tokens - 1
    # A batch starts together: both members of the first batch were sent at the same time.
    assert result.records[0].sent_at == result.records[1].sent_at < result.records[2].sent_at
    assert Path(tiny_llama_dir).is_dir()

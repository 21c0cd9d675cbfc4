"""KV tiers under a pool on the GPU: blocks read out of the cupy backend's pool and loaded into
another engine's give the bits that engine's own cached blocks give."""

from __future__ import annotations

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, KVTierConfig
from shared.sampling import SamplingParams

DOCUMENT = [(7 * i + 3) % 5000 + 1 for i in range(320)]  # 20 full blocks of 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)


def cupy_engine(tiers: tuple[str, ...], folder: str) -> Engine:
    return Engine(
        EngineConfig(
            backend="cupy",
            dtype="bfloat16",
            cache=CacheConfig(kv_memory_bytes=64 << 20),
            kv_tiers=KVTierConfig(tiers=tiers, disk_dir=folder, load_min_tokens=16),
        )
    )


def answer(engine: Engine, question: int) -> tuple[list[tuple[int, float]], int]:
    (completion,) = engine.generate([[*DOCUMENT, question, question + 1]], GREEDY)
    return [(lp.token_id, lp.logprob) for lp in completion.logprobs], completion.loaded_tokens


def test_gpu_pool_blocks_round_trip_through_the_host_and_disk_tiers(tmp_path) -> None:
    writer = cupy_engine(("host", "disk"), str(tmp_path))
    answer(writer, 11)
    reference, loaded = answer(writer, 21)  # its own pool holds the document
    assert loaded == 0
    reader = cupy_engine(("host", "disk"), str(tmp_path))  # another process's pool, empty
    found, loaded = answer(reader, 21)
    assert loaded == len(DOCUMENT)
    assert found == reference and found

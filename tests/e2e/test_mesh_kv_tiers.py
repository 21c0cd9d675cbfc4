"""KV tiers through the whole mesh: a prefix computed on one worker is loaded by another from
the mesh's Redis, and by a restarted worker from its disk folder."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from tests.e2e.mesh_helpers import assert_one_terminal, collect, ids_request

DOCUMENT = [(7 * i + 3) % 250 + 1 for i in range(160)]  # 10 full blocks of 16


def tier_mesh(model_dir: str, log_dir: str, tiers: str, disk_dir: str) -> MeshConfig:
    return MeshConfig(
        model=model_dir,
        workers=2,
        worker_threads=1,
        worker_args=[
            *("--kv-memory", "16MiB", "--kv-tiers", tiers, "--kv-disk-dir", disk_dir),
            *("--kv-load-min-tokens", "32"),
        ],
        gateway_args=["--routing", "round-robin"],
        log_dir=log_dir,
        drain_seconds=2,
    )


async def generate(address: str, question: list[int], timeout: float = 60):  # type: ignore[no-untyped-def]
    """The document and a question, greedy with logprobs. A request refused or failed while a
    restarted worker's scheduler reattaches is sent again."""
    deadline = time.monotonic() + timeout
    request = ids_request(
        DOCUMENT + question, max_tokens=8, ignore_eos=True, logprobs=1, temperature=0.0
    )
    while True:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                events = await collect(inference_pb2_grpc.InferenceStub(channel), request)
            except grpc.aio.AioRpcError as refused:  # MODEL_NOT_READY until it reattaches
                assert time.monotonic() < deadline, refused
                await asyncio.sleep(0.2)
                continue
        if assert_one_terminal(events) == "completed":
            return events
        assert time.monotonic() < deadline, events[-1]
        await asyncio.sleep(0.2)


def answer(events) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    return [
        (lp.token_id, lp.logprob) for e in events if e.HasField("delta") for lp in e.delta.logprobs
    ]


async def test_other_worker_loads_the_prefix_from_redis(tiny_llama_dir: str, tmp_path) -> None:
    config = tier_mesh(tiny_llama_dir, str(tmp_path / "logs"), "redis", str(tmp_path / "disk"))
    with Mesh(config) as mesh:
        first = await generate(mesh.gateway_address, [11, 12, 13])
        second = await generate(mesh.gateway_address, [21, 22, 23])  # round robin: the other
        again = await generate(mesh.gateway_address, [21, 22, 23])  # the first: its own pool
    workers = {e[-1].completed.execution.scheduler for e in (first, second)}
    assert len(workers) == 2
    assert first[-1].completed.timings.loaded_tokens == 0
    assert second[-1].completed.timings.loaded_tokens == len(DOCUMENT)
    # Loaded blocks give the bits the other worker's own cached blocks give.
    assert answer(second) == answer(again) and answer(second)


async def test_restarted_worker_loads_the_prefix_from_disk(tiny_llama_dir: str, tmp_path) -> None:
    config = tier_mesh(tiny_llama_dir, str(tmp_path / "logs"), "disk", str(tmp_path / "disk"))
    config.workers = 1
    with Mesh(config) as mesh:
        first = await generate(mesh.gateway_address, [11, 12, 13])
        await until_files(tmp_path / "disk", len(DOCUMENT) // 16)  # the writes are off-step
        mesh.restart("engine-worker-0")  # SIGKILL: its pool is gone, its disk folder is not
        after_restart = await generate(mesh.gateway_address, [21, 22, 23])
        again = await generate(mesh.gateway_address, [21, 22, 23])
    assert first[-1].completed.timings.loaded_tokens == 0
    assert after_restart[-1].completed.timings.loaded_tokens == len(DOCUMENT)
    assert again[-1].completed.timings.loaded_tokens == 0  # its own pool has them now
    assert answer(after_restart) == answer(again) and answer(again)


async def until_files(folder, count: int, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("*.kvb"))) < count:
        assert time.monotonic() < deadline, "the disk tier never got the prefix's blocks"
        await asyncio.sleep(0.05)

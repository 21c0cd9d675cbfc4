"""One tenant's use of the mesh does not become another's wait. A flood with large n: with the
batch full of the flood's sequences and the queue past the gateway's watermark, the other
tenant's requests are still admitted, their TTFT within 2x of an idle mesh's, while the flood's
next request is refused RATE_LIMITED, naming its fair share. Tokenizing: the tokenizer's time
counts against the caller's tokens per minute. The simulated engine (2 ms steps) behind the
default model's tokenizer: this is about admission, not arithmetic."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared import redis_keys
from shared.pb.kvmesh.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from shared.runtime.tls import aio_channel
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    bearer,
    ids_request,
    keys_file,
    mesh_redis,
    rich_error,
)

KEYS = """
[tenants.flood]
keys = ["sk-flood"]

[tenants.light]
keys = ["sk-light"]

[tenants.counter]
keys = ["sk-counter"]
tokens_per_minute = 600
"""
SLOTS = 8


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = keys_file(tmp_path_factory, KEYS)
    config = MeshConfig(
        worker_args=["--backend", "sim", "--sim-step-ms", "2", "--kv-memory", "64MiB"],
        scheduler_args=["--max-num-seqs", str(SLOTS)],
        # A watermark the flood passes at once: its sequences hold every slot for seconds.
        gateway_args=["--api-keys-file", keys, "--max-queue-ms", "200"],
        log_dir=str(tmp_path_factory.mktemp("flood-logs")),
        drain_seconds=1,
    )
    with Mesh(config) as running:
        yield running


async def light_ttft(stub: inference_pb2_grpc.InferenceStub, index: int) -> float:
    started = time.monotonic()
    request = ids_request([3, 4, 5 + index], max_tokens=2, temperature=0.0)
    async for event in stub.Generate(request, metadata=bearer("sk-light"), timeout=60):
        if event.WhichOneof("event") == "delta":
            return time.monotonic() - started
    raise AssertionError("no token")


async def reason(
    stub: inference_pb2_grpc.InferenceStub, key: str, n: int = 12, max_tokens: int = 900
) -> str:
    """One request of n long completions, read to its end: how it ended."""
    request = ids_request([9, 9, 9], max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    request.n = n
    try:
        async for _event in stub.Generate(request, metadata=bearer(key), timeout=120):
            pass
    except grpc.aio.AioRpcError as error:
        return rich_error(error).reason
    return "completed"


async def load_when(
    mesh: Mesh, wanted: Callable[[scheduler_pb2.LoadReport], bool]
) -> scheduler_pb2.LoadReport:
    async with aio_channel(mesh.scheduler_addresses[0], token=mesh.secrets.mesh_token) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        deadline = time.monotonic() + 30
        while not wanted(load := await stub.GetLoad(scheduler_pb2.LoadRequest())):
            assert time.monotonic() < deadline, f"never reached: {load}"
            await asyncio.sleep(0.02)
        return load


async def published_idle(mesh: Mesh) -> None:
    """Until the scheduler's published load shows no tenant (it lags by up to a flush):
    the next test's gateway would otherwise still count the last one's requests."""
    client = mesh_redis(mesh)
    key = redis_keys.scheduler_load(mesh.scheduler_addresses[0])
    deadline = time.monotonic() + 10
    while await client.hget(key, "tenants") != b"{}":
        assert time.monotonic() < deadline, await client.hgetall(key)
        await asyncio.sleep(0.02)
    await client.aclose()


async def refusal(stub: inference_pb2_grpc.InferenceStub, key: str) -> str:
    """Why a one-token request is refused, once the gateway sees the scheduler's published
    load (a few steps behind GetLoad's): until then one may still be admitted."""
    deadline = time.monotonic() + 10
    while (outcome := await reason(stub, key, n=1, max_tokens=1)) == "completed":
        assert time.monotonic() < deadline, "never refused"
        await asyncio.sleep(0.05)
    return outcome


def flood_in(load: scheduler_pb2.LoadReport) -> bool:
    """All 12 of the flood's sequences there: 8 running, 4 queued."""
    held = {t.tenant: (t.num_running, t.num_waiting) for t in load.tenants}
    return held.get("flood") == (SLOTS, 12 - SLOTS)


async def cancelled(tasks: list[asyncio.Task[str]]) -> None:
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks)


async def test_a_tenant_flooding_with_large_n_leaves_another_admitted_and_fast(
    mesh: Mesh,
) -> None:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await light_ttft(stub, 0)  # warm
        alone = [await light_ttft(stub, index) for index in range(1, 6)]
        # n = 12 for 8 slots: alone, the flood may fill the mesh.
        running = [asyncio.create_task(reason(stub, "sk-flood"))]
        await load_when(mesh, flood_in)
        beside = [await light_ttft(stub, index) for index in range(6, 11)]
        # With the light tenant's requests there, the flood holds past its half of the slots.
        running.append(asyncio.create_task(reason(stub, "sk-light", n=1, max_tokens=600)))
        await load_when(mesh, lambda load: "light" in {t.tenant for t in load.tenants})
        late = await refusal(stub, "sk-flood")
        await cancelled(running)
    # The light tenant's every request was admitted (a refusal raises in light_ttft), and the
    # flood's next one is refused for its own share, not the light tenant for the mesh's load.
    assert late == "RATE_LIMITED"
    # The light request takes a flood sequence's slot and prefills in a step of its own; the
    # 50 ms is the flood's streaming on the same two cores.
    assert statistics.median(beside) <= 2 * statistics.median(alone) + 0.05, (alone, beside)
    await assert_mesh_idle(mesh)
    await published_idle(mesh)


async def test_the_flood_alone_past_the_watermark_is_overloaded_not_rate_limited(
    mesh: Mesh,
) -> None:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        running = [asyncio.create_task(reason(stub, "sk-flood"))]
        await load_when(mesh, flood_in)
        late = await refusal(stub, "sk-flood")
        await cancelled(running)
    assert late == "OVERLOADED"  # nobody else is there: the mesh itself is full
    await assert_mesh_idle(mesh)


async def test_tokenize_calls_count_against_the_tenants_tokens(mesh: Mesh) -> None:
    """Tokenize and CountTokens generate nothing, but the tokenizer's time is the tenant's:
    600 tokens a minute run out after a few 150-token prompts, and then its Generate waits
    too; another tenant tokenizes on."""
    request = inference_pb2.TokenizeRequest(text="hello world " * 75)
    counts: list[int] = []
    refused = ""
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for index in range(20):
            call = stub.CountTokens if index % 2 else stub.Tokenize
            try:
                reply = await call(request, metadata=bearer("sk-counter"), timeout=10)
            except grpc.aio.AioRpcError as error:
                refused = rich_error(error).reason
                break
            counts.append(reply.count if index % 2 else len(reply.token_ids))
        assert refused == "RATE_LIMITED" and sum(counts) >= 600 - max(counts), counts
        assert len(counts) <= 600 // min(counts) + 1, counts
        other = await stub.Tokenize(request, metadata=bearer("sk-light"), timeout=10)
        assert len(other.token_ids) == counts[0]
        late = await reason(stub, "sk-counter", n=1, max_tokens=10)
    assert late == "RATE_LIMITED"

"""Two worker pairs behind one gateway, sharing a real redis-server: cache-aware routing,
tenants (auth, rate limits, cache isolation), and Redis going away and coming back under
load. Runs on the tiny random Llama: this is about the mesh."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from shared.runtime.tls import aio_channel
from shared.tenants import Tenant
from tests.e2e.mesh_helpers import assert_one_terminal, bearer, ids_request, keys_file, rich_error

KEYS = """
[tenants.acme]
keys = ["sk-acme"]

[tenants.beta]
keys = ["sk-beta"]

[tenants.limited]
keys = ["sk-limited"]
requests_per_second = 0.5

[tenants.wordy]
keys = ["sk-wordy"]
tokens_per_minute = 600
"""
PROMPT = [(7 * i) % 200 + 3 for i in range(120)]  # 7 full blocks of 16 for the prefix cache


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = keys_file(tmp_path_factory, KEYS)
    config = MeshConfig(
        model=tiny_llama_dir,
        workers=2,
        worker_threads=1,
        worker_args=["--kv-memory", "16MiB"],
        scheduler_args=["--max-num-seqs", "4"],  # a small, clear capacity
        gateway_args=["--api-keys-file", keys, "--max-total-tokens", "500"],
        log_dir=str(tmp_path_factory.mktemp("mesh-redis-logs")),
        drain_seconds=2,
    )
    with Mesh(config) as running:
        yield running


async def generate(
    mesh: Mesh, request: inference_pb2.GenerateRequest, key: str = "sk-acme"
) -> list[inference_pb2.GenerateEvent]:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return [e async for e in stub.Generate(request, metadata=bearer(key), timeout=60)]


# ---- tenants ---------------------------------------------------------------------------------


async def test_requests_without_a_valid_key_are_unauthenticated(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for metadata in ((), bearer("sk-wrong")):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await collect_with(stub, ids_request([1, 2, 3], max_tokens=2), metadata)
            error = rich_error(raised.value)
            assert (error.code, error.reason) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "UNAUTHENTICATED",
            )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ListModels(inference_pb2.ListModelsRequest())
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    log = pathlib.Path(mesh.service("gateway").log_path).read_text()
    assert "auth on" in log and "sk-wrong" not in log and "sk-acme" not in log


async def collect_with(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...],
) -> list[inference_pb2.GenerateEvent]:
    return [e async for e in stub.Generate(request, metadata=metadata, timeout=30)]


async def test_a_tenant_over_its_rate_is_refused_with_retry_info(mesh: Mesh) -> None:
    request = ids_request([1, 2, 3], max_tokens=2)
    assert assert_one_terminal(await generate(mesh, request, "sk-limited")) == "completed"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await generate(mesh, request, "sk-limited")
    error = rich_error(raised.value)
    assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")
    assert error.retryable and error.retry_delay_ms is not None
    assert 0 < error.retry_delay_ms <= 2000  # one request per 2 s
    # Other tenants are not affected.
    assert assert_one_terminal(await generate(mesh, request, "sk-beta")) == "completed"


async def test_prompts_refused_before_admission_count_against_the_tenants_tokens(
    mesh: Mesh,
) -> None:
    """Five 120-token prompts with no room for their output (past --max-total-tokens) use up
    a 600 tokens-a-minute tenant: its next request waits for the refill, as if they had run."""
    for _ in range(5):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await generate(mesh, ids_request(PROMPT, max_tokens=1000), "sk-wordy")
        assert rich_error(raised.value).reason == "PROMPT_TOO_LONG"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await generate(mesh, ids_request(PROMPT[:50], max_tokens=50), "sk-wordy")
    error = rich_error(raised.value)
    assert error.reason == "RATE_LIMITED" and "tokens per minute" in raised.value.details()
    # Its 100 tokens fit the 600 a minute unless the refused prompts were charged.
    assert error.retry_delay_ms is not None and error.retry_delay_ms <= 10_000
    request = ids_request(PROMPT[:50], max_tokens=50)
    assert assert_one_terminal(await generate(mesh, request, "sk-beta")) == "completed"


# ---- cache-aware routing and tenant isolation ------------------------------------------------


async def test_a_repeated_prompt_goes_where_its_prefix_is_cached(mesh: Mesh) -> None:
    request = ids_request(PROMPT, max_tokens=4, ignore_eos=True)
    first = await generate(mesh, request)
    home = first[-1].completed.execution.scheduler
    decision = first[0].accepted.routing
    assert decision.scheduler == home and decision.reason in ("least-loaded", "prefix")
    second = await _until_routed_by_prefix(mesh, request)
    routing = second[-1].completed.execution.routing
    assert (routing.scheduler, routing.reason) == (home, "prefix")
    assert routing.matched_blocks == (len(PROMPT) - 1) // 16
    assert second[-1].completed.usage.cached_tokens == routing.matched_tokens
    assert second[-1].completed.execution.tenant == "acme"


async def _until_routed_by_prefix(
    mesh: Mesh, request: inference_pb2.GenerateRequest
) -> list[inference_pb2.GenerateEvent]:
    """Schedulers publish a few steps late: ask until the gateway sees the cached prefix."""
    deadline = time.monotonic() + 5
    while True:
        events = await generate(mesh, request)
        if events[0].accepted.routing.reason == "prefix":
            return events
        assert time.monotonic() < deadline, f"never routed by prefix: {events[0]}"
        await asyncio.sleep(0.2)


async def test_another_tenant_gets_no_hit_on_the_same_prompt(mesh: Mesh) -> None:
    request = ids_request(PROMPT[::-1], max_tokens=4, ignore_eos=True)
    await _until_routed_by_prefix(mesh, request)  # cached for acme, and Redis knows
    beta = await generate(mesh, request, "sk-beta")
    assert beta[0].accepted.routing.matched_blocks == 0  # in Redis routing
    assert beta[-1].completed.usage.cached_tokens == 0
    # In the engine too, on the very worker that holds acme's blocks: the scheduler matches
    # them under acme's salt and nothing under any other tenant's.
    acme_home = (await _until_routed_by_prefix(mesh, request))[0].accepted.routing.scheduler
    token = mesh.secrets.mesh_token  # auth is on: a scheduler answers the mesh's own alone
    assert await _submit_cached_tokens(acme_home, Tenant("acme").cache_salt, token) > 0
    assert await _submit_cached_tokens(acme_home, Tenant("gamma").cache_salt, token) == 0


async def _submit_cached_tokens(scheduler_address: str, salt: bytes, token: str) -> int:
    async with aio_channel(scheduler_address, token=token) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        submit = scheduler_pb2.SubmitRequest(
            request_id=f"direct-{time.monotonic_ns()}",
            token_ids=PROMPT[::-1],
            sampling=ids_request([], max_tokens=1, temperature=0.0, seed=1).sampling,
            cache_salt=salt,
        )
        events = [e async for e in stub.Submit(submit, timeout=30)]
    return events[-1].finished.cached_tokens


# ---- Redis failure ---------------------------------------------------------------------------


async def test_redis_stopped_and_restarted_under_load_loses_nothing(mesh: Mesh) -> None:
    redis_process = mesh.service("redis").process
    outcomes: list[str] = []
    stop = asyncio.Event()

    async def client(stub: inference_pb2_grpc.InferenceStub, worker: int) -> None:
        index = 0
        while not stop.is_set():
            request = ids_request(PROMPT[: 40 + worker], max_tokens=8, ignore_eos=True)
            events = [
                e async for e in stub.Generate(request, metadata=bearer("sk-acme"), timeout=30)
            ]
            outcomes.append(assert_one_terminal(events))
            index += 1

    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        clients = [asyncio.create_task(client(stub, i)) for i in range(4)]
        await asyncio.sleep(1.0)
        redis_process.kill()  # Redis gone mid-load
        redis_process.wait()
        await asyncio.sleep(2.0)
        during = len(outcomes)
        mesh.restart("redis", wait_ready=False)  # back, same ACL user and password, empty
        await asyncio.sleep(2.5)
        stop.set()
        await asyncio.gather(*clients)  # any failed request raises here
    assert set(outcomes) == {"completed"} and len(outcomes) > during > 0
    # Back to shared state: the schedulers republished their caches, and the gateway
    # routes by prefix again.
    request = ids_request(PROMPT, max_tokens=2, ignore_eos=True)
    assert (await _until_routed_by_prefix(mesh, request))[0].accepted.routing.reason == ("prefix")
    logs = pathlib.Path(mesh.service("gateway").log_path).read_text()
    assert logs.count("redis unreachable") == 1 and "redis reachable again" in logs

"""Several models and versions on one mesh from a model repository, and rollouts under traffic.

The repository: alpha@1 and alpha@2 (tiny Llamas with different weights, so each version's
greedy output is its own), alpha@3 (alpha@1's bytes with a warm-up fixture they do not
produce), beta@1 (a tiny Qwen2), smol@1 (SmolLM2: the one model with a tokenizer), delta@1
(never started). The mesh starts serving alpha@1, beta and smol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.cli import main
from kvmesh.mesh.control_server import serve_control
from kvmesh.mesh.launcher import Mesh
from kvmesh.mesh.rollout import RolloutController
from services.engine_worker.worker import Worker
from shared.config import CacheConfig, EngineConfig
from shared.errors import KvmeshError
from shared.model_entry import ServingConfig, WarmupFixture, write_entry
from shared.model_repository import ModelRepository
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    model_admin_pb2,
    model_admin_pb2_grpc,
)
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    collect,
    ids_request,
    rich_error,
    tiny_mesh_config,
)
from tests.model_fixtures import save_random_checkpoint

PROMPT = [5, 6, 7, 8, 9]
BASE = {("alpha", "1"), ("beta", "1"), ("smol", "1")}  # what the mesh serves between tests
TOKENS = 6


def _greedy(directory: str) -> tuple[int, ...]:
    config = EngineConfig(
        model=directory, backend="torch", cache=CacheConfig(kv_memory_bytes=4 << 20)
    )
    return tuple(Worker(config).greedy(PROMPT, TOKENS))


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: str,
    tiny_qwen2_dir: str,
    default_model_path: str,
) -> ModelRepository:
    repo = ModelRepository(str(tmp_path_factory.mktemp("repo")))
    other_weights = save_random_checkpoint(tmp_path_factory.mktemp("llama-v2"), "llama", seed=1)
    small = ServingConfig(kv_memory="16MiB", chunk_size=32)
    for name, source in (("alpha", tiny_llama_dir), ("alpha", other_weights)):
        entry = repo.add(name, source, serving=small)
        fixture = WarmupFixture(tuple(PROMPT), _greedy(entry.directory))
        write_entry(dataclasses.replace(entry, fixtures=(fixture,)))
    bad = repo.add("alpha", tiny_llama_dir, serving=small)
    wrong = tuple((t + 1) % 512 for t in _greedy(bad.directory))
    write_entry(dataclasses.replace(bad, fixtures=(WarmupFixture(tuple(PROMPT), wrong),)))
    repo.add("beta", tiny_qwen2_dir, serving=small, aliases=("b",))
    repo.add("smol", default_model_path, serving=small)  # the one with a tokenizer of its own
    repo.add("delta", tiny_llama_dir, serving=small)  # never started: no tokenizer for it
    return repo


@pytest.fixture(scope="module")
def models_mesh(
    repository: ModelRepository, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    config = tiny_mesh_config("", str(tmp_path_factory.mktemp("models-mesh-logs")))
    config.model = None
    config.models = ["alpha@1", "beta", "smol"]
    config.model_repo = repository.root
    with Mesh(config) as running:
        yield running


def _expected(repository: ModelRepository) -> dict[str, tuple[int, ...]]:
    return {v: repository.entry("alpha", v).fixtures[0].expected_ids for v in ("1", "2")}


async def test_models_route_by_name_version_and_alias(
    models_mesh: Mesh, repository: ModelRepository
) -> None:
    async with grpc.aio.insecure_channel(models_mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        listed = await stub.ListModels(inference_pb2.ListModelsRequest())
        served = [(m.name, m.version) for m in listed.models]
        assert served[0] == ("alpha", "1") and set(served) == {*BASE}
        states = {(v.name, v.version): (v.state, v.traffic_percent) for v in listed.versions}
        assert states == dict.fromkeys(BASE, ("ready", 100.0))
        beta = next(m for m in listed.models if m.name == "beta")
        assert list(beta.aliases) == ["b"] and beta.architecture == "Qwen2ForCausalLM"
        expected = _expected(repository)
        for model, name in (("", "alpha"), ("alpha", "alpha"), ("alpha@1", "alpha"), ("b", "beta")):
            request = ids_request(PROMPT, max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
            request.model = model
            events = await collect(stub, request)
            assert events[0].accepted.model == name and events[0].accepted.model_version == "1"
            execution = events[-1].completed.execution
            assert (execution.model_name, execution.model_version) == (name, "1")
            if name == "alpha":
                tokens = tuple(t for e in events if e.HasField("delta") for t in e.delta.token_ids)
                assert tokens == expected["1"]
        for unknown in ("gamma", "alpha@9"):
            request = ids_request(PROMPT, max_tokens=2)
            request.model = unknown
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub, request)
            error = rich_error(refused.value)
            assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")

        # Each model's own tokenizer: smol's turns text into tokens and back; alpha has none.
        chat = inference_pb2.GenerateRequest(
            model="smol",
            text="The capital of France is",
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
        )
        events = await collect(stub, chat)
        assert events[-1].WhichOneof("event") == "completed"
        assert "".join(e.delta.text for e in events if e.HasField("delta")).strip()
        chat.model = "alpha"
        with pytest.raises(grpc.aio.AioRpcError) as no_tokenizer:
            await collect(stub, chat)
        assert rich_error(no_tokenizer.value).reason == "TOKENIZER_UNAVAILABLE"

        health = health_pb2_grpc.HealthStub(channel)
        for service in ("alpha", "alpha@1", "beta"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_a_model_still_loading_is_not_ready_with_retry_info(models_mesh: Mesh) -> None:
    with socket.socket() as probe:  # a scheduler that never answers: a model forever loading
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    async with grpc.aio.insecure_channel(models_mesh.gateway_address) as channel:
        admin = model_admin_pb2_grpc.ModelAdminStub(channel)
        stub = inference_pb2_grpc.InferenceStub(channel)
        await admin.AddBackend(
            model_admin_pb2.AddBackendRequest(address=address, model="gamma", version="1")
        )
        try:
            request = ids_request(PROMPT, max_tokens=2)
            request.model = "gamma"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub, request)
            error = rich_error(refused.value)
            assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "MODEL_NOT_READY")
            assert error.retryable and error.retry_delay_ms
            listed = await stub.ListModels(inference_pb2.ListModelsRequest())
            gamma = next(v for v in listed.versions if v.name == "gamma")
            assert (gamma.state, gamma.replicas, gamma.ready_replicas) == ("loading", 1, 0)
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="gamma"))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            removed = await admin.RemoveBackend(
                model_admin_pb2.RemoveBackendRequest(address=address, drain_timeout_s=1)
            )
        assert removed.streams_left == 0
        listed = await stub.ListModels(inference_pb2.ListModelsRequest())
        assert "gamma" not in {v.name for v in listed.versions}


class SteadyTraffic:
    """Unpinned greedy requests for alpha, `concurrency` at a time, until stopped."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, concurrency: int = 3) -> None:
        self.stub = stub
        self.results: list[tuple[int, str, str, tuple[int, ...]]] = []  # (seq, kind, version, ids)
        self._sequence = 0
        self._stopping = False
        self._tasks = [asyncio.create_task(self._client()) for _ in range(concurrency)]

    async def _client(self) -> None:
        while not self._stopping:
            sequence = self._sequence
            self._sequence += 1
            request = ids_request(PROMPT, max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
            request.model = "alpha"
            events = await collect(self.stub, request)
            version = events[0].accepted.model_version
            tokens = tuple(t for e in events if e.HasField("delta") for t in e.delta.token_ids)
            terminal = events[-1].WhichOneof("event") or ""
            if terminal == "completed":
                assert events[-1].completed.execution.model_version == version
            self.results.append((sequence, terminal, version, tokens))

    def mark(self) -> int:
        return self._sequence

    async def wait_for(self, count: int, since: int) -> list[str]:
        """The versions of `count` requests started at or after `since`."""
        while len([r for r in self.results if r[0] >= since]) < count:
            await asyncio.sleep(0.05)
        return [version for seq, _, version, _ in sorted(self.results) if seq >= since][:count]

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._tasks)


async def _rollout(steps: Iterator[object]) -> list[object]:
    return await asyncio.to_thread(list, steps)


async def test_deploy_canary_promote_and_roll_back_under_traffic(
    models_mesh: Mesh, repository: ModelRepository
) -> None:
    controller = RolloutController(models_mesh)
    async with grpc.aio.insecure_channel(models_mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        traffic = SteadyTraffic(stub)
        assert set(await traffic.wait_for(6, 0)) == {"1"}

        await _rollout(controller.deploy("alpha", "2", canary_percent=25))
        canary = Counter(await traffic.wait_for(40, traffic.mark()))
        assert 6 <= canary["2"] <= 14 and canary["1"] + canary["2"] == 40  # 25% of 40, +-4

        await _rollout(controller.deploy("alpha", "2"))  # promote: v1 drained and stopped
        assert set(await traffic.wait_for(12, traffic.mark())) == {"2"}
        assert {p.version for p in models_mesh.pairs if p.name == "alpha"} == {"2"}
        gateway_command = models_mesh.service("gateway").command
        schedulers = gateway_command[gateway_command.index("--scheduler") + 1]
        assert "alpha@2=" in schedulers and "alpha@1=" not in schedulers  # for a restart

        await _rollout(controller.rollback("alpha"))
        assert set(await traffic.wait_for(12, traffic.mark())) == {"1"}
        assert {p.version for p in models_mesh.pairs if p.name == "alpha"} == {"1"}

        with pytest.raises(KvmeshError, match="holds none for it"):
            await _rollout(controller.deploy("delta", "1"))  # the mesh has no tokenizer for it
        with pytest.raises(KvmeshError, match="warm-up fixture 0 output differs"):
            await _rollout(controller.deploy("alpha", "3"))  # its fixture fails: never ready
        assert set(await traffic.wait_for(6, traffic.mark())) == {"1"}
        await traffic.stop()

        listed = await stub.ListModels(inference_pb2.ListModelsRequest())
        assert {(v.name, v.version) for v in listed.versions} == BASE
    expected = _expected(repository)
    kinds = Counter(kind for _, kind, _, _ in traffic.results)
    assert kinds == {"completed": len(traffic.results)}, kinds  # nothing failed or was cut
    for _, _, version, tokens in traffic.results:
        assert tokens == expected[version]  # the version it names is the one that answered
    assert {version for _, _, version, _ in traffic.results} == {"1", "2"}
    await assert_mesh_idle(models_mesh)


def test_models_cli_deploys_through_the_control_port(
    models_mesh: Mesh, repository: ModelRepository, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    control = serve_control(RolloutController(models_mesh), address)
    try:
        repo = ["models", "--repo", repository.root]
        assert main([*repo, "deploy", "beta", "1", "--control", address]) == 0
        out = capsys.readouterr().out
        assert "traffic for beta: 1 100%" in out and "beta@1 deployed" in out
        assert main([*repo, "rollback", "beta", "--control", address]) != 0
        assert "no earlier version" in capsys.readouterr().err
        assert main([*repo, "list", "--addr", models_mesh.gateway_address]) == 0
        lines = capsys.readouterr().out.splitlines()
        beta = next(line for line in lines if line.startswith("beta@1"))
        assert beta.endswith("ready on 1/1 worker(s), 100% of traffic")
        assert next(line for line in lines if line.startswith("alpha@2")).endswith("not loaded")
    finally:
        control.stop(grace=1.0)

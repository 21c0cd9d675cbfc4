"""Helpers for tests against a real mesh: collecting streams, reading rich errors, loads."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass

import grpc
import openai
import pytest
import redis.asyncio as redis
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from shared.runtime.tls import aio_channel

TERMINAL = ("completed", "cancelled", "failed")


@dataclass
class RichError:
    """What a client in any language reads from the rich error model."""

    code: grpc.StatusCode
    reason: str
    retryable: bool
    retry_delay_ms: int | None  # None: no RetryInfo


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata presenting an API key."""
    return (("authorization", f"Bearer {key}"),)


def keys_file(tmp_path_factory: pytest.TempPathFactory, text: str) -> str:
    """An API keys file holding `text`: its path."""
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(text)
    return str(path)


def mesh_redis(mesh: Mesh) -> redis.Redis:
    """A client of the mesh's own Redis, logged in with its credentials (auth on: an ACL user
    and password `kvmesh up` made)."""
    assert mesh.redis_url is not None
    secrets = mesh.secrets
    login = {"username": secrets.redis_user or None, "password": secrets.redis_password or None}
    return redis.Redis.from_url(mesh.redis_url, **login)


def rich_error(error: grpc.RpcError) -> RichError:
    """Parsed with grpcio-status, as any Python client would, not with kvmesh's own code."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, f"no google.rpc.Status in {error}"
    reason, retryable, delay = "", False, None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            assert info.domain == "kvmesh.dev"
            reason, retryable = info.reason, info.metadata["retryable"] == "true"
        elif detail.Unpack(retry):
            delay = retry.retry_delay.ToMilliseconds()
    return RichError(error.code(), reason, retryable, delay)  # type: ignore[attr-defined]


def text_request(text: str, **sampling: object) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        text=text,
        sampling=common_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def chat_request(content: str, **sampling: object) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        chat=common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content=content)]),
        sampling=common_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def ids_request(ids: list[int], **sampling: object) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


async def collect(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest,
    timeout: float | None = 120,
) -> list[inference_pb2.GenerateEvent]:
    return [event async for event in stub.Generate(request, timeout=timeout)]


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[inference_pb2.GenerateEvent]:
    """The remaining events of a call already read with read() (the two styles don't mix)."""
    events = []
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


def kinds(events: list[inference_pb2.GenerateEvent]) -> list[str]:
    return [str(e.WhichOneof("event")) for e in events]


def assert_one_terminal(events: list[inference_pb2.GenerateEvent]) -> str:
    """Accepted first, exactly one terminal event, and it is last."""
    names = kinds(events)
    assert names[0] == "accepted", names
    terminals = [n for n in names if n in TERMINAL]
    assert len(terminals) == 1 and names[-1] == terminals[0], names
    return terminals[0]


def output_text(events: list[inference_pb2.GenerateEvent]) -> str:
    return "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")


def output_ids(events: list[inference_pb2.GenerateEvent]) -> list[int]:
    return [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]


async def settled_load(
    scheduler_address: str, timeout: float = 30, recent_frees: bool = False, token: str = ""
) -> scheduler_pb2.LoadReport:
    """The scheduler's load once nothing is queued or running (`token`: its mesh's, with
    auth on)."""
    async with aio_channel(scheduler_address, token=token) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        deadline = time.monotonic() + timeout
        while True:
            load = await stub.GetLoad(scheduler_pb2.LoadRequest(include_recent_frees=recent_frees))
            if load.num_running == 0 and load.num_waiting == 0:
                return load
            assert time.monotonic() < deadline, f"requests still in flight: {load}"
            await asyncio.sleep(0.02)


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN
        return int(reply.status)


async def wait_health(address: str, serving: bool, timeout: float = 60) -> None:
    wanted = health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + timeout
    while (await health_status(address) == wanted) != serving:
        assert time.monotonic() < deadline, f"{address} never turned serving={serving}"
        await asyncio.sleep(0.05)


def tiny_mesh_config(model_dir: str, log_dir: str) -> MeshConfig:
    """A mesh of a tiny random model: starts in seconds, one thread, a 16 MiB KV pool."""
    return MeshConfig(
        model=model_dir,
        worker_threads=1,
        worker_args=["--kv-memory", "16MiB"],
        log_dir=log_dir,
        drain_seconds=2,
    )


def metric_value(metrics_url: str, name: str, token: str = "") -> float:
    """One unlabelled sample from a service's Prometheus endpoint (`token`: with auth on,
    the mesh's or the scrape token)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(metrics_url, headers=headers)
    with urllib.request.urlopen(request, timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in {metrics_url}")


async def assert_mesh_idle(mesh: Mesh, timeout: float = 30) -> None:
    """The invariants once traffic stops: no request queued, running or with an open stream
    anywhere, every KV block free or cached (no reference held)."""
    for address in mesh.scheduler_addresses:
        load = await settled_load(address, timeout, token=mesh.secrets.mesh_token)
        deadline = time.monotonic() + timeout
        while load.num_open_streams or load.num_blocks_referenced:
            assert time.monotonic() < deadline, f"{address} leaked: {load}"
            await asyncio.sleep(0.05)
            load = await settled_load(address, timeout, token=mesh.secrets.mesh_token)
    for gateway in mesh.gateways:
        assert gateway.metrics_url is not None
        deadline = time.monotonic() + timeout
        url, token = gateway.metrics_url, mesh.secrets.mesh_token
        while metric_value(url, "kvmesh_gateway_requests_in_flight", token):
            assert time.monotonic() < deadline, f"{gateway.name} still holds streams"
            await asyncio.sleep(0.05)


async def model_name(client: openai.AsyncOpenAI) -> str:
    """The default model's name, as the OpenAI front lists it first."""
    return (await client.models.list()).data[0].id

"""Tenants kept apart, request limits enforced before any work, a tenant whose requests keep
failing in the engine refused alone, and no secrets or content in logs or spans. A tiny-model
mesh with auth on; the content check runs on the real model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import redis.asyncio as redis

from kvmesh.mesh.launcher import Mesh
from shared import redis_keys
from shared.pb.kvmesh.v1 import (
    engine_worker_pb2,
    engine_worker_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    model_admin_pb2,
    model_admin_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    traces_pb2,
    traces_pb2_grpc,
)
from shared.runtime.tls import aio_channel
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    assert_one_terminal,
    bearer,
    collect,
    ids_request,
    keys_file,
    mesh_redis,
    output_text,
    read_rest,
    rich_error,
    text_request,
    tiny_mesh_config,
)

KEYS = """
[tenants.acme]
keys = ["sk-acme-9f2c"]

[tenants.beta]
keys = ["sk-beta-41d7"]

[tenants.ops]
keys = ["sk-ops-77e1"]
admin = true
"""
MAX_BYTES, MAX_PROMPT, MAX_TOTAL, MAX_STREAMS = 4096, 64, 600, 2
POISON, TENANT_FAILURES = 511, 4  # a prompt holding the tiny model's last id fails in a step


ACME, BETA, OPS = bearer("sk-acme-9f2c"), bearer("sk-beta-41d7"), bearer("sk-ops-77e1")


@pytest.fixture(scope="module")
def guarded_mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = keys_file(tmp_path_factory, KEYS)
    config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("guarded-logs")))
    config.worker_args = [*config.worker_args, "--inject-fault-token", f"{POISON}:1"]
    config.gateway_args = [
        "--tenant-failures-per-minute",
        str(TENANT_FAILURES),
        "--api-keys-file",
        keys,
        "--max-request-bytes",
        str(MAX_BYTES),
        "--max-prompt-tokens",
        str(MAX_PROMPT),
        "--max-total-tokens",
        str(MAX_TOTAL),
        "--max-streams-per-tenant",
        str(MAX_STREAMS),
    ]
    with Mesh(config) as running:
        yield running


@pytest.fixture
async def inference(guarded_mesh: Mesh):
    async with grpc.aio.insecure_channel(guarded_mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def start(inference, metadata, request_id: str = "") -> grpc.aio.UnaryStreamCall:
    request = ids_request([1, 2, 3], max_tokens=500, ignore_eos=True)
    request.request_id = request_id
    call = inference.Generate(request, metadata=metadata)
    assert (await call.read()).WhichOneof("event") == "accepted"
    assert (await call.read()).WhichOneof("event") == "delta"
    return call


async def test_a_tenant_can_neither_see_nor_abort_another_tenants_request(
    guarded_mesh: Mesh, inference
) -> None:
    acme = await start(inference, ACME, "job-1")
    beta = await start(inference, BETA, "job-1")  # the same id: no clash, nothing revealed
    other = await inference.Abort(inference_pb2.AbortRequest(request_id="job-2"), metadata=BETA)
    assert not other.found
    own = await inference.Abort(inference_pb2.AbortRequest(request_id="job-1"), metadata=BETA)
    assert own.found
    assert (await read_rest(beta))[-1].WhichOneof("event") == "cancelled"
    # acme's job-1 never noticed: it still streams, then its owner aborts it.
    assert (await acme.read()).WhichOneof("event") == "delta"
    mine = await inference.Abort(inference_pb2.AbortRequest(request_id="job-1"), metadata=ACME)
    assert mine.found
    assert (await read_rest(acme))[-1].WhichOneof("event") == "cancelled"
    await assert_mesh_idle(guarded_mesh)


async def test_model_admin_needs_an_admin_tenant(guarded_mesh: Mesh) -> None:
    request = model_admin_pb2.SetTrafficRequest(model="nobody", percent={"1": 100.0})
    async with grpc.aio.insecure_channel(guarded_mesh.gateway_address) as channel:
        admin = model_admin_pb2_grpc.ModelAdminStub(channel)
        for metadata, code, reason in (
            ((), grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
            (ACME, grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin.SetTraffic(request, metadata=metadata)
            error = rich_error(refused.value)
            assert (error.code, error.reason, error.retryable) == (code, reason, False)
        await admin.SetTraffic(request, metadata=OPS)
        await admin.SetTraffic(model_admin_pb2.SetTrafficRequest(model="nobody"), metadata=OPS)


@pytest.mark.parametrize(
    ("request_", "reason", "says"),
    [
        (ids_request([150] * 3000, max_tokens=4), "REQUEST_TOO_LARGE", f"at most {MAX_BYTES}"),
        (ids_request([7] * (MAX_PROMPT + 1), max_tokens=4), "PROMPT_TOO_LONG", "at most 64"),
        (ids_request([7] * 10, max_tokens=MAX_TOTAL), "PROMPT_TOO_LONG", "lower max_tokens"),
    ],
    ids=["bytes", "prompt-tokens", "total-tokens"],
)
async def test_size_limits_refuse_before_any_work(
    guarded_mesh: Mesh, inference, request_, reason: str, says: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect_as(inference, ACME, request_)
    error = rich_error(refused.value)
    assert (error.code, error.reason, error.retryable) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        reason,
        False,
    )
    assert says in refused.value.details()


def test_an_oversized_http_body_is_413_request_too_large(guarded_mesh: Mesh) -> None:
    body = json.dumps({"model": "x", "prompt": "y" * (MAX_BYTES + 1)}).encode()
    request = urllib.request.Request(
        guarded_mesh.http_url + "/completions",
        data=body,
        headers={"Authorization": "Bearer sk-acme-9f2c", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413
    assert json.load(refused.value)["error"]["code"] == "REQUEST_TOO_LARGE"


async def test_streams_per_tenant_are_bounded_across_the_mesh(
    guarded_mesh: Mesh, inference
) -> None:
    held = [await start(inference, ACME) for _ in range(MAX_STREAMS)]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(inference, ids_request([1, 2], max_tokens=2), timeout=10)
    assert rich_error(refused.value).code == grpc.StatusCode.UNAUTHENTICATED  # no key at all
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect_as(inference, ACME)
    error = rich_error(refused.value)
    assert (error.code, error.reason, error.retryable) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RATE_LIMITED",
        True,
    )
    scheduler = guarded_mesh.scheduler_addresses[0]
    async with aio_channel(scheduler, token=guarded_mesh.secrets.mesh_token) as channel:
        load = await scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(scheduler_pb2.LoadRequest())
    assert load.num_open_streams == MAX_STREAMS  # the refused one never reached it
    assert assert_one_terminal(await collect_as(inference, BETA)) == "completed"  # its own bound
    for call in held:
        call.cancel()
    await assert_mesh_idle(guarded_mesh)


async def test_no_internal_port_answers_a_caller_without_the_mesh_token(
    guarded_mesh: Mesh, inference
) -> None:
    """The attack: a tenant's live stream aborted at its scheduler, a Submit as another tenant
    at the most urgent priority. Each internal port refuses anyone but the mesh's own."""
    victim = await start(inference, ACME, request_id="victim-1")
    abort = scheduler_pb2.SchedulerAbortRequest(request_id="acme/victim-1")
    submit = scheduler_pb2.SubmitRequest(
        request_id="ops-1", token_ids=[1, 2, 3], tenant="ops", priority=-1_000_000
    )
    trace_export = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    mesh = guarded_mesh
    calls = [
        (mesh.scheduler_addresses[0], lambda c: scheduler_pb2_grpc.SchedulerStub(c).Abort(abort)),
        (
            mesh.scheduler_addresses[0],
            lambda c: read_rest(scheduler_pb2_grpc.SchedulerStub(c).Submit(submit)),
        ),
        (
            mesh.tokenizer_addresses[0],
            lambda c: tokenizer_pb2_grpc.TokenizerStub(c).Encode(
                tokenizer_pb2.EncodeRequest(text="hi")
            ),
        ),
        (
            mesh.worker_addresses[0],
            lambda c: engine_worker_pb2_grpc.EngineWorkerStub(c).GetInfo(
                engine_worker_pb2.WorkerInfoRequest()
            ),
        ),
        (mesh.collector_address, lambda c: c.unary_unary(trace_export)(b"")),
    ]
    for address, call in calls:
        async with grpc.aio.insecure_channel(address) as outsider:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(outsider)
            error = rich_error(refused.value)
            assert error.code == grpc.StatusCode.UNAUTHENTICATED, address
            assert error.reason == "UNAUTHENTICATED"
    delta = await victim.read()  # still streaming: the abort never reached its scheduler
    assert delta.WhichOneof("event") == "delta"
    victim.cancel()
    async with aio_channel(mesh.scheduler_addresses[0], token=mesh.secrets.mesh_token) as own:
        stub = scheduler_pb2_grpc.SchedulerStub(own)  # the mesh's own credential: answered
        assert not (await stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_id="none"))).found
    await assert_mesh_idle(guarded_mesh)


async def test_the_mesh_redis_answers_its_own_services_alone(guarded_mesh: Mesh) -> None:
    """Started by `kvmesh up` with auth on: an ACL user with a generated password, the
    default user off. A client without it (or with a guess) gets nothing; the services
    logged in (their loads are published there)."""
    assert guarded_mesh.redis_url is not None
    for login in ({}, {"password": "guess"}, {"username": "kvmesh", "password": "guess"}):
        outsider = redis.Redis.from_url(guarded_mesh.redis_url, **login)
        with pytest.raises(redis.AuthenticationError):
            await outsider.keys("*")
        await outsider.aclose()
    own = mesh_redis(guarded_mesh)
    key = redis_keys.scheduler_load(guarded_mesh.scheduler_addresses[0])
    assert await own.exists(key)
    await own.aclose()
    assert guarded_mesh.secrets.redis_password not in " ".join(
        guarded_mesh.service("redis").command
    )


def test_every_metrics_port_wants_a_token_when_auth_is_on(guarded_mesh: Mesh) -> None:
    """No KVMESH_METRICS_TOKEN given: the mesh token is the scrape token, so no metrics port
    is left open beside the guarded gRPC ones."""
    scraped = 0
    for service in guarded_mesh.services:
        if service.metrics_url is None:
            continue
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(service.metrics_url, timeout=5)
        assert refused.value.code == 401, service.name
        token = {"Authorization": f"Bearer {guarded_mesh.secrets.mesh_token}"}
        request = urllib.request.Request(service.metrics_url, headers=token)
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert b"# HELP" in reply.read(), service.name
        scraped += 1
    assert scraped >= 5  # collector, tokenizer, engine-worker, scheduler, gateway


async def collect_as(
    inference, metadata, request: inference_pb2.GenerateRequest | None = None
) -> list[inference_pb2.GenerateEvent]:
    request = request or ids_request([1, 2], max_tokens=2)
    return [e async for e in inference.Generate(request, metadata=metadata, timeout=10)]


async def test_a_tenant_whose_requests_keep_failing_is_refused_and_the_others_served(
    guarded_mesh: Mesh, inference
) -> None:
    """50 requests of one tenant that fail in the engine: its first few fail, the rest are
    refused RATE_LIMITED; the worker's breaker never trips, and another tenant's requests are
    all served, as fast as alone (within 2x)."""

    async def beta_latencies(count: int) -> list[float]:
        seconds = []
        for index in range(count):
            started = time.monotonic()
            events = await collect_as(inference, BETA, ids_request([4, 5, index], max_tokens=8))
            assert assert_one_terminal(events) == "completed"
            seconds.append(time.monotonic() - started)
        return seconds

    async def acme_flood() -> list[str]:
        reasons = []
        for index in range(50):
            try:
                events = await collect_as(inference, ACME, ids_request([POISON, index]))
                reasons.append(events[-1].failed.error.reason)
            except grpc.aio.AioRpcError as error:
                reasons.append(rich_error(error).reason)
        return reasons

    alone = statistics.median(await beta_latencies(8))
    flood = asyncio.create_task(acme_flood())
    beside = await beta_latencies(8)
    reasons = await flood
    assert reasons == ["EXECUTION_FAILED"] * TENANT_FAILURES + ["RATE_LIMITED"] * (
        50 - TENANT_FAILURES
    )
    assert statistics.median(beside) <= 2 * alone, (alone, beside)
    listed = await inference.ListModels(inference_pb2.ListModelsRequest(), metadata=BETA)
    assert sum(v.ready_replicas for v in listed.versions) == 1  # the breaker never tripped
    await assert_mesh_idle(guarded_mesh)


async def test_a_huge_request_id_is_refused_before_any_log_holds_it(
    guarded_mesh: Mesh, inference
) -> None:
    request = ids_request([1, 2], max_tokens=2)
    request.request_id = "x" * 1_000_000
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect_as(inference, ACME, request)
    error = rich_error(refused.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    gateway_log = pathlib.Path(guarded_mesh.service("gateway").log_path).read_text()
    assert "x" * 1000 not in gateway_log


async def test_a_seed_using_all_64_bits_is_traced_like_any_other(
    guarded_mesh: Mesh, inference
) -> None:
    """OTLP integers are signed: the gateway's span export once failed on such a seed."""
    request = ids_request([1, 2], max_tokens=2, seed=(1 << 64) - 1)
    request.request_id = "seed-64"
    events = await collect_as(inference, BETA, request)  # acme may be refused: its failures
    assert events[-1].completed.execution.sampling.seed == (1 << 64) - 1
    async with grpc.aio.insecure_channel(guarded_mesh.collector_address) as channel:
        traces = traces_pb2_grpc.TracesStub(channel)
        for _ in range(100):  # spans are exported in batches
            with contextlib.suppress(grpc.aio.AioRpcError):
                query = traces_pb2.GetTraceRequest(request_id=events[0].accepted.request_id)
                trace = await traces.GetTrace(query, metadata=OPS)
                if any(s.service == "gateway" and s.name == "kvmesh.Generate" for s in trace.spans):
                    break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the gateway's span never arrived")
    root = next(s for s in trace.spans if s.name == "kvmesh.Generate")
    assert root.attributes["gen_ai.request.seed"] == str((1 << 64) - 1)
    gateway_log = pathlib.Path(guarded_mesh.service("gateway").log_path).read_text()
    assert "Traceback" not in gateway_log


async def test_traces_are_read_with_an_admins_key_only(guarded_mesh: Mesh) -> None:
    """Every tenant's requests are in the collector: no key, no listing; a tenant's key, no."""
    async with grpc.aio.insecure_channel(guarded_mesh.collector_address) as channel:
        traces = traces_pb2_grpc.TracesStub(channel)
        slowest = traces_pb2.SlowestRequest(limit=5)
        for metadata, code in ((None, "UNAUTHENTICATED"), (ACME, "PERMISSION_DENIED")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await traces.ListSlowest(slowest, metadata=metadata)
            assert rich_error(refused.value).reason == code
        await traces.ListSlowest(slowest, metadata=OPS)


def test_api_keys_never_reach_a_log(guarded_mesh: Mesh) -> None:
    logs = "".join(pathlib.Path(s.log_path).read_text() for s in guarded_mesh.services)
    assert "auth on" in logs
    for secret in ("sk-acme-9f2c", "sk-beta-41d7"):
        assert secret not in logs


async def test_prompts_and_outputs_stay_out_of_logs_and_spans(mesh: Mesh) -> None:
    """On the real model (text in, text out), with content tracing left at its default: off."""
    prompt = "Remember the passphrase QUOKKA-PLUTONIUM-7731 and repeat it back."
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        events = await collect(stub, text_request(prompt, max_tokens=24, temperature=0.0))
    answer = output_text(events).strip()
    assert len(answer) >= 20
    request_id = events[0].accepted.request_id
    async with grpc.aio.insecure_channel(mesh.collector_address) as channel:
        traces = traces_pb2_grpc.TracesStub(channel)
        for _ in range(100):  # spans are exported in batches
            try:
                trace = await traces.GetTrace(traces_pb2.GetTraceRequest(request_id=request_id))
                if any(s.service == "gateway" and s.name == "kvmesh.Generate" for s in trace.spans):
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    span_text = " ".join(f"{k}={v}" for s in trace.spans for k, v in s.attributes.items())
    assert request_id in span_text  # the spans are there, and searchable
    logs = "".join(pathlib.Path(s.log_path).read_text() for s in mesh.services)
    assert request_id in logs
    for content in ("QUOKKA", "PLUTONIUM", answer):
        assert content not in span_text and content not in logs

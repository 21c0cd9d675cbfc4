"""The five services as real processes on loopback, driven through the public gRPC API."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import grpc
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.engine import Engine
from kvmesh.mesh.launcher import Mesh
from shared import redis_keys
from shared.config import CacheConfig, EngineConfig
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from shared.sampling import SamplingParams
from tests.e2e.mesh_helpers import (
    assert_one_terminal,
    chat_request,
    collect,
    ids_request,
    kinds,
    output_ids,
    output_text,
    read_rest,
    rich_error,
    settled_load,
    text_request,
)

PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"prompt": "The three primary colors are"},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"token_ids": [504, 3575, 282, 4649, 314]},  # "The capital of France is"
]
SAMPLINGS = [
    SamplingParams(max_tokens=24, temperature=0.0),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7),
]


def to_request(prompt: dict, params: SamplingParams) -> inference_pb2.GenerateRequest:
    sampling = {"max_tokens": params.max_tokens, "temperature": params.temperature}
    sampling |= {"top_p": params.top_p} if params.top_p != 1.0 else {}
    sampling |= {"seed": params.seed} if params.seed is not None else {}
    if "messages" in prompt:
        return chat_request(prompt["messages"][0]["content"], **sampling)
    if "prompt" in prompt:
        return text_request(prompt["prompt"], **sampling)
    return ids_request(prompt["token_ids"], **sampling)


@pytest.fixture
async def inference(mesh: Mesh):
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def test_mesh_output_equals_the_in_process_engine(mesh: Mesh, inference) -> None:
    cases = [(p, s) for p in PROMPTS for s in SAMPLINGS]
    streams = await asyncio.gather(*(collect(inference, to_request(p, s)) for p, s in cases))
    engine = Engine(EngineConfig(cache=CacheConfig(kv_memory_bytes=256 << 20)))
    expected = engine.generate([p for p, _ in cases], [s for _, s in cases])
    for events, completion in zip(streams, expected, strict=True):
        assert assert_one_terminal(events) == "completed"
        assert output_ids(events) == completion.token_ids
        assert output_text(events) == completion.text
    await settled_load(mesh.scheduler_addresses[0])


async def test_completed_carries_usage_timings_and_execution_record(inference) -> None:
    request = chat_request("Say hello.", max_tokens=8, temperature=0.7)
    request.stop.append("never in this answer")
    events = await collect(inference, request)
    assert kinds(events)[-2:] == ["usage", "completed"]
    accepted, completed = events[0].accepted, events[-1].completed
    assert accepted.request_id.startswith("req-") and accepted.prompt_tokens > 0
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    assert deltas[0].first_token and not any(d.first_token for d in deltas[1:])
    usage = completed.usage
    assert usage.prompt_tokens == accepted.prompt_tokens
    assert usage.completion_tokens == len(output_ids(events)) <= 8
    record = completed.execution
    assert record.model_name == accepted.model and len(record.artifact_digest) == 64
    assert record.model_version == record.artifact_digest[:12]
    assert (record.backend, record.dtype) == ("torch", "float32")
    assert record.sampling.HasField("seed") and record.seed == record.sampling.seed
    assert record.sampling.temperature == pytest.approx(0.7) and record.sampling.top_p == 1.0
    # What else the result depends on: software, device, threads, tokenizer, stop strings.
    assert record.runtime["torch"] == torch.__version__ and record.runtime["llguidance"]
    assert record.runtime["kvmesh"] and record.device.startswith("cpu") and record.threads == 2
    assert record.tokenizer_digest == record.artifact_digest  # a GGUF holds its tokenizer
    assert list(record.stop) == ["never in this answer"]
    assert [a.attempt_id for a in record.attempts] == [f"{accepted.request_id}#1"]
    timings = completed.timings
    assert 0 < timings.ttft_ms <= timings.total_ms
    assert timings.prefill_ms > 0 and timings.queue_ms >= 0


async def test_the_reported_seed_reproduces_a_sampled_answer(inference) -> None:
    first = await collect(inference, chat_request("Name a fruit.", max_tokens=12, temperature=1.0))
    seed = first[-1].completed.execution.seed
    again = await collect(
        inference, chat_request("Name a fruit.", max_tokens=12, temperature=1.0, seed=seed)
    )
    assert output_ids(again) == output_ids(first)


async def test_stop_string_across_token_boundaries_is_trimmed(mesh: Mesh, inference) -> None:
    request = chat_request("Describe the ocean in two sentences.", max_tokens=40, temperature=0.0)
    full = await collect(inference, request)
    pieces = [e.delta.text for e in full if e.WhichOneof("event") == "delta"]
    text = "".join(pieces)
    # A stop string made of the end of one delta and the start of the next.
    boundary = next(
        i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[boundary][-2:] + pieces[boundary + 1][:2]
    cut = text.index(stop)
    request.stop.append(stop)
    stopped = await collect(inference, request)
    assert assert_one_terminal(stopped) == "completed"
    completed = stopped[-1].completed
    assert completed.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert completed.stop_string == stop
    assert output_text(stopped) == text[:cut]
    assert completed.usage.completion_tokens < len(output_ids(full))
    # Timed like any other finish: the scheduler's queue and prefill, the gateway's decode.
    timings = completed.timings
    assert timings.queue_ms > 0 and timings.prefill_ms > 0 and timings.decode_ms > 0
    assert timings.queue_ms + timings.prefill_ms + timings.decode_ms <= timings.total_ms
    # The same chat again: its prompt is served from the prefix cache, and the finish says so.
    assert completed.usage.cached_tokens >= 16  # at least one full block
    load = await settled_load(mesh.scheduler_addresses[0])
    assert load.num_free_blocks == load.num_blocks


async def test_detokenize_stream_never_emits_a_broken_character(mesh: Mesh) -> None:
    text = "Emoji 👋🏽 and 🇫🇷, CJK 世界你好, accents héllo."
    async with grpc.aio.insecure_channel(mesh.tokenizer_address) as channel:
        tokenizer = tokenizer_pb2_grpc.TokenizerStub(channel)
        ids = (await tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=text))).token_ids
        call = tokenizer.Detokenize()
        pieces = []
        for index, token in enumerate(ids):
            last = index == len(ids) - 1
            await call.write(tokenizer_pb2.DetokenizeRequest(token_ids=[token], finish=last))
            pieces.append((await call.read()).text)
    assert len(ids) > len(text) // 4  # multi-byte characters span several byte-level tokens
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text
    assert "" in pieces  # some tokens held back until their character was complete


async def test_cancelling_100_streams_leaks_no_blocks(mesh: Mesh, inference) -> None:
    rng = random.Random(0)
    cancelled_at: dict[str, int] = {}

    async def cancel_later(index: int) -> None:
        request = text_request(f"Story {index}: once upon a time", max_tokens=64, ignore_eos=True)
        call = inference.Generate(request)
        accepted = await call.read()
        await asyncio.sleep(rng.uniform(0.0, 3.0))  # queued, prefilling or decoding
        cancelled_at[accepted.accepted.request_id] = time.time_ns()
        call.cancel()

    await asyncio.gather(*(cancel_later(i) for i in range(100)))
    load = await settled_load(mesh.scheduler_addresses[0], recent_frees=True)
    assert load.num_free_blocks == load.num_blocks, "KV blocks leaked"
    freed_at = {f.request_id: f.freed_unix_ns for f in load.recent_frees}
    latencies_ms = [
        (freed_at[rid] - at) / 1e6 for rid, at in cancelled_at.items() if rid in freed_at
    ]
    assert len(latencies_ms) >= 90  # the rest finished before their cancel landed
    p50 = statistics.median(latencies_ms)
    p99 = statistics.quantiles(latencies_ms, n=100)[98]
    print(
        f"\ndisconnect-to-freed over {len(latencies_ms)} streams: "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )
    assert p99 < 2000


async def test_deadline_passing_mid_decode_ends_with_failed_and_frees_blocks(
    mesh: Mesh, inference
) -> None:
    before = await settled_load(mesh.scheduler_addresses[0])
    request = text_request("A very long story:", max_tokens=2000, ignore_eos=True)
    # 2,000 tokens take 30 s or more on this model and CPU even alone: 12 s ends it mid-decode,
    # and leaves room for a first token on a machine kept busy by something else. The mesh's
    # own deadline (timeout_ms), not the client's gRPC one: the mesh ends the request, and no
    # transport deadline of the client's races the `failed` event on a starved machine.
    request.timeout_ms = 12_000
    events = await collect(inference, request, timeout=120.0)
    assert assert_one_terminal(events) == "failed"
    assert events[-1].failed.error.reason == "DEADLINE_EXCEEDED"
    assert events[-2].usage.completion_tokens > 0
    after = await settled_load(mesh.scheduler_addresses[0])
    assert after.num_free_blocks == after.num_blocks
    assert after.num_expired_running == before.num_expired_running + 1


async def test_abort_by_id_ends_the_stream_with_cancelled(mesh: Mesh, inference) -> None:
    call = inference.Generate(text_request("Tell me everything:", max_tokens=500, ignore_eos=True))
    accepted = await call.read()
    await call.read()  # a first delta: it is running
    reply = await inference.Abort(
        inference_pb2.AbortRequest(request_id=accepted.accepted.request_id)
    )
    assert reply.found
    rest = await read_rest(call)
    assert kinds(rest)[-2:] == ["usage", "cancelled"]
    assert rest[-1].cancelled.reason == "abort"
    unknown = await inference.Abort(inference_pb2.AbortRequest(request_id="no-such-request"))
    assert not unknown.found
    await settled_load(mesh.scheduler_addresses[0])


async def test_prompt_too_long_is_refused_before_acceptance(inference) -> None:
    model = await inference.GetModel(inference_pb2.GetModelRequest())
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(inference, ids_request([1] * (model.max_model_len + 1), max_tokens=4))
    error = rich_error(refused.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_TOO_LONG")
    assert not error.retryable and error.retry_delay_ms is None


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (inference_pb2.GenerateRequest(), "INVALID_ARGUMENT"),  # no input at all
        (ids_request([10**6]), "INVALID_ARGUMENT"),  # outside the vocabulary
        (text_request("hi", temperature=-1.0), "INVALID_SAMPLING_PARAMS"),
        (text_request("hi", top_p=0.0), "INVALID_SAMPLING_PARAMS"),
        (inference_pb2.GenerateRequest(text="hi", stop=[""]), "INVALID_ARGUMENT"),
        (inference_pb2.GenerateRequest(text="hi", model="no-such-model"), "MODEL_NOT_FOUND"),
    ],
)
async def test_bad_requests_get_a_stable_reason(inference, request_, reason) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(inference, request_)
    error = rich_error(refused.value)
    assert error.reason == reason and not error.retryable
    expected = (
        grpc.StatusCode.NOT_FOUND
        if reason == "MODEL_NOT_FOUND"
        else grpc.StatusCode.INVALID_ARGUMENT
    )
    assert error.code == expected


async def test_models_tokenize_and_count(inference) -> None:
    listed = (await inference.ListModels(inference_pb2.ListModelsRequest())).models
    model = await inference.GetModel(inference_pb2.GetModelRequest())
    assert [m.name for m in listed] == [model.name]
    assert model.architecture == "LlamaForCausalLM" and "Q4_1" in model.quantization
    assert model.kv_blocks > 0 and model.vocab_size == 49152
    text = inference_pb2.TokenizeRequest(text="The capital of France is")
    assert list((await inference.Tokenize(text)).token_ids) == [504, 3575, 282, 4649, 314]
    chat = inference_pb2.TokenizeRequest(
        chat=common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    )
    count = await inference.CountTokens(chat)
    assert count.count > 5 and count.max_output_tokens == model.max_model_len - count.count


async def test_every_service_has_health_and_reflection(mesh: Mesh) -> None:
    for service in mesh.services:
        if service.address is None:
            continue  # redis
        async with grpc.aio.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", "liveness"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service.name
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = reflection.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = {s.name for s in (await call.read()).list_services_response.service}
            call.cancel()
            assert "grpc.health.v1.Health" in listed and len(listed) >= 3, service.name


async def test_scheduler_publishes_its_load_to_redis(mesh: Mesh) -> None:
    assert mesh.redis_url is not None
    client = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    key = redis_keys.scheduler_load(mesh.scheduler_addresses[0])
    deadline = time.monotonic() + 5
    while not client.exists(key):
        assert time.monotonic() < deadline, "no load published"
        await asyncio.sleep(0.1)
    load = client.hgetall(key)
    async with grpc.aio.insecure_channel(mesh.scheduler_addresses[0]) as channel:
        report = await scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(
            scheduler_pb2.LoadRequest()
        )
    assert int(load["blocks"]) == report.num_blocks and load["ready"] == "1"
    assert 0 < client.pttl(key) <= redis_keys.LOAD_TTL_MS


def test_log_lines_about_a_request_carry_its_id(mesh: Mesh) -> None:
    with open(mesh.service("gateway").log_path) as log:
        lines = [json.loads(line) for line in log]
    accepted = [line for line in lines if line["msg"] == "accepted"]
    # Ids the gateway made up ("req-..."), and the clients' own where they sent one (other
    # modules on this mesh do), in any order of the modules.
    assert accepted and all(line["request_id"] for line in accepted)
    assert any(line["request_id"].startswith("req-") for line in accepted)
    finished = {line["request_id"] for line in lines if line["msg"] in ("completed", "failed")}
    assert finished <= {line["request_id"] for line in accepted}

"""Response formats through the real mesh: the worker compiles a format before the request
queues, constrained and free requests share steps, and a bad schema is refused up front."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import assert_one_terminal, chat_request, collect, rich_error
from tests.engine_worker.test_structured_output import SCHEMAS


def constrained(schema_text: str, seed: int) -> object:
    request = chat_request(
        "Answer with one JSON value.", max_tokens=160, temperature=1.0, seed=seed
    )
    request.sampling.response_format.CopyFrom(
        common_pb2.ResponseFormat(kind="json_schema", spec=schema_text)
    )
    return request


async def test_constrained_and_free_requests_share_the_mesh(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        schemas = SCHEMAS[:4]
        requests = [constrained(json.dumps(s), seed) for s in schemas for seed in (1, 2)]
        free = chat_request("Say hello.", max_tokens=16, temperature=0.0)
        streams = await asyncio.gather(*(collect(inference, r) for r in [*requests, free]))
    finished = 0
    for index, events in enumerate(streams[:-1]):
        assert assert_one_terminal(events) == "completed"
        completed = events[-1].completed
        if completed.finish_reason != common_pb2.FINISH_REASON_STOP:
            continue
        finished += 1
        text = "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
        jsonschema.validate(json.loads(text), schemas[index // 2])
    assert finished >= len(requests) * 0.75
    assert assert_one_terminal(streams[-1]) == "completed"


@pytest.mark.parametrize(
    "spec",
    [
        '{"type": "objekt"}',
        "{not json",
        '{"$ref": "#"}',  # admits no output: once a free sample, then INVALID_OUTPUT
        '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}',
    ],
)
async def test_an_invalid_schema_is_refused_before_acceptance(mesh: Mesh, spec: str) -> None:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(inference, constrained(spec, 1))
    error = rich_error(refused.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_SCHEMA" and not error.retryable

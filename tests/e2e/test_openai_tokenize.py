"""vLLM's /tokenize and /detokenize on the shared mesh's OpenAI front."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.test_openai_http import raw_post


def post(mesh: Mesh, path: str, body: dict) -> tuple[int, dict]:
    response, raw = raw_post(mesh.http_url.removesuffix("/v1"), path, body)
    return response.status, json.loads(raw)


async def test_tokenize_answers_what_the_grpc_api_encodes(mesh: Mesh) -> None:
    status, text = await asyncio.to_thread(
        post, mesh, "/tokenize", {"prompt": "The capital of France is"}
    )
    assert status == 200
    assert text["tokens"] == [504, 3575, 282, 4649, 314] and text["count"] == 5
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, chat = await asyncio.to_thread(post, mesh, "/tokenize", {"messages": messages})
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        expected = await inference.Tokenize(
            inference_pb2.TokenizeRequest(
                chat=common_pb2.Chat(messages=[common_pb2.ChatMessage(**m) for m in messages])
            )
        )
        model = await inference.GetModel(inference_pb2.GetModelRequest())
    assert status == 200 and chat["tokens"] == list(expected.token_ids)
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == model.max_model_len


async def test_detokenize_returns_the_text_tokenize_encoded(mesh: Mesh) -> None:
    text = "Paris, naïve café — 42 €"
    _, tokens = await asyncio.to_thread(post, mesh, "/tokenize", {"prompt": text})
    status, back = await asyncio.to_thread(post, mesh, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and back == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/tokenize", {}, "'prompt'"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "not both"),
        ("/detokenize", {"tokens": ["a"]}, "'tokens'"),
        ("/detokenize", {"tokens": [10**7]}, "outside the vocabulary"),
    ],
)
async def test_bad_bodies_are_400_naming_the_field(
    mesh: Mesh, path: str, body: dict, words: str
) -> None:
    status, answer = await asyncio.to_thread(post, mesh, path, body)
    assert status == 400 and answer["error"]["code"] == "INVALID_ARGUMENT"
    assert words in answer["error"]["message"]

"""Embeddings on the real mesh: all-MiniLM-L6-v2 from its package, through Embed and
/v1/embeddings, matched against sentence-transformers; concurrent calls share forward passes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import openai
import pytest
import torch

from kvmesh.mesh.launcher import DEFAULT_EMBEDDER, Mesh
from shared.model_paths import default_embedding_model_path
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import ids_request, metric_value, rich_error, tiny_mesh_config

TEXTS = ["kvmesh streams tokens over gRPC.", "A cat sat on the mat.", "Ünïcödé 🚀", "word " * 300]


@pytest.fixture(scope="module")
def embed_mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("embed-mesh-logs")))
    config.embedder = "default"
    with Mesh(config) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(default_embedding_model_path(), device="cpu")
    return torch.tensor(model.encode(TEXTS))


@pytest.fixture
async def inference(embed_mesh: Mesh) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(embed_mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def _close(vectors: torch.Tensor, expected: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(vectors, expected, dim=-1)
    assert cosine.min().item() > 1 - 1e-4, cosine


async def test_embed_matches_sentence_transformers(
    inference: inference_pb2_grpc.InferenceStub, reference: torch.Tensor
) -> None:
    request = inference_pb2.EmbedRequest(inputs=[common_pb2.EmbedInput(text=t) for t in TEXTS])
    reply = await inference.Embed(request)  # no model named: the default embedding model
    assert (reply.model, reply.model_version) == (DEFAULT_EMBEDDER, "0")
    vectors = torch.tensor([list(e.values) for e in reply.embeddings])
    _close(vectors, reference)
    assert reply.embeddings[3].num_tokens == 256  # cut at the model's max_seq_length
    assert reply.prompt_tokens == sum(e.num_tokens for e in reply.embeddings)
    listed = await inference.ListModels(inference_pb2.ListModelsRequest())
    tasks = {m.name: (m.task, m.embedding_dimensions) for m in listed.models}
    assert tasks[DEFAULT_EMBEDDER] == ("embed", 384) and ("generate", 0) in tasks.values()


async def test_concurrent_calls_share_forward_passes(
    embed_mesh: Mesh, inference: inference_pb2_grpc.InferenceStub, reference: torch.Tensor
) -> None:
    embedder = embed_mesh.service("embedder-0")
    assert embedder.metrics_url is not None
    before = metric_value(embedder.metrics_url, "kvmesh_embed_batch_size_count")

    async def one(text: str) -> list[float]:
        request = inference_pb2.EmbedRequest(
            model=DEFAULT_EMBEDDER, inputs=[common_pb2.EmbedInput(text=text)]
        )
        return list((await inference.Embed(request)).embeddings[0].values)

    vectors = await asyncio.gather(*(one(TEXTS[i % 4]) for i in range(32)))
    _close(torch.tensor(vectors), reference.repeat(8, 1))
    passes = metric_value(embedder.metrics_url, "kvmesh_embed_batch_size_count") - before
    assert passes < 32  # 32 calls, fewer forward passes: they were batched


async def test_openai_client_embeddings(embed_mesh: Mesh, reference: torch.Tensor) -> None:
    async with openai.AsyncOpenAI(base_url=embed_mesh.http_url, api_key="x", max_retries=0) as c:
        floats = await c.embeddings.create(
            model=DEFAULT_EMBEDDER, input=TEXTS, encoding_format="float"
        )
        packed = await c.embeddings.create(model=DEFAULT_EMBEDDER, input=TEXTS)  # base64
        assert floats.model == DEFAULT_EMBEDDER and floats.usage.prompt_tokens > 0
        for reply in (floats, packed):
            assert [d.index for d in reply.data] == [0, 1, 2, 3]
            _close(torch.tensor([d.embedding for d in reply.data]), reference)
        with pytest.raises(openai.BadRequestError) as raised:
            await c.embeddings.create(model=DEFAULT_EMBEDDER, input="hi", dimensions=128)
        assert "'dimensions' must be 384" in str(raised.value)
        with pytest.raises(openai.NotFoundError):
            await c.embeddings.create(model="no-such-model", input="hi")


async def test_embedding_errors_are_clear(inference: inference_pb2_grpc.InferenceStub) -> None:
    cases = [
        (inference_pb2.EmbedRequest(), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (
            inference_pb2.EmbedRequest(
                inputs=[common_pb2.EmbedInput(token_ids=common_pb2.TokenIds(ids=[101] * 300))]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "PROMPT_TOO_LONG",
        ),
        (
            inference_pb2.EmbedRequest(model="nope", inputs=[common_pb2.EmbedInput(text="a")]),
            grpc.StatusCode.NOT_FOUND,
            "MODEL_NOT_FOUND",
        ),
    ]
    for request, code, reason in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await inference.Embed(request)
        assert (rich_error(refused.value).code, rich_error(refused.value).reason) == (code, reason)
    generate = ids_request([1, 2], max_tokens=2)
    generate.model = DEFAULT_EMBEDDER  # an embedding model cannot generate
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in inference.Generate(generate):
            pass
    error = rich_error(refused.value)
    assert error.reason == "INVALID_ARGUMENT" and "use Embed" in refused.value.details()

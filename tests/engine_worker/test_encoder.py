"""The sentence encoder against sentence-transformers on the same all-MiniLM-L6-v2 files."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine_worker.embed.batcher import EmbedBatcher
from services.engine_worker.embed.encoder import SentenceEncoder
from shared.errors import KvmeshError, Reason
from shared.model_paths import default_embedding_model_path, is_encoder

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "kvmesh streams tokens over gRPC.",
    "A",
    "Paged attention keeps KV blocks in a pool; " * 40,  # past 256 tokens: truncated alike
    "Ünïcödé, emoji 🚀 and numbers 3.14159 mixed in.",
]


@pytest.fixture(scope="module")
def minilm_path() -> str:
    return default_embedding_model_path()


@pytest.fixture(scope="module")
def encoder(minilm_path: str) -> SentenceEncoder:
    return SentenceEncoder(minilm_path)


def test_vectors_match_sentence_transformers(encoder: SentenceEncoder, minilm_path: str) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(minilm_path, device="cpu")
    expected = torch.tensor(reference.encode(TEXTS, batch_size=len(TEXTS)))
    ids = encoder.encode_texts(TEXTS)
    assert max(len(i) for i in ids) == encoder.config.max_seq_length == 256
    batched = encoder.embed(ids)
    assert batched.shape == expected.shape == (len(TEXTS), 384)
    cosine = torch.nn.functional.cosine_similarity(batched, expected, dim=-1)
    assert cosine.min().item() > 1 - 1e-4, cosine
    assert torch.allclose(batched.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    # Grouped by length in passes of 2: the same rows, in input order.
    grouped = encoder.embed_sorted(ids, chunk=2)
    assert torch.nn.functional.cosine_similarity(grouped, batched, dim=-1).min() > 1 - 1e-6
    # Alone or padded beside longer inputs: the same vector.
    for row, single in enumerate(ids):
        alone = encoder.embed([single])[0]
        assert torch.nn.functional.cosine_similarity(alone, batched[row], dim=0) > 1 - 1e-6


def test_the_default_embedding_model_is_an_encoder(minilm_path: str) -> None:
    assert is_encoder(minilm_path)


def test_bad_inputs_are_refused(encoder: SentenceEncoder) -> None:
    for ids, reason in (
        ([], Reason.EMPTY_PROMPT),
        ([101] * 257, Reason.PROMPT_TOO_LONG),
        ([101, 10**6], Reason.INVALID_ARGUMENT),
    ):
        with pytest.raises(KvmeshError) as refused:
            encoder.check_ids(ids)
        assert refused.value.reason is reason


async def test_concurrent_calls_share_batches() -> None:
    batches: list[list[list[int]]] = []

    async def embed(batch: list[list[int]]) -> list[list[float]]:
        batches.append(batch)
        await asyncio.sleep(0.05)  # while this batch runs, the next gathers
        return [[float(len(ids))] for ids in batch]

    batcher = EmbedBatcher(embed, max_batch_tokens=12)
    calls = [batcher.embed([[1] * n]) for n in (1, 2, 3, 4, 5)]
    results = await asyncio.gather(*calls)
    assert [r[0][0] for r in results] == [1.0, 2.0, 3.0, 4.0, 5.0]
    # Five calls, two forward passes, cut where inputs x longest would pass 12 tokens.
    assert [[len(ids) for ids in batch] for batch in batches] == [[1, 2, 3], [4, 5]]
    await batcher.close()

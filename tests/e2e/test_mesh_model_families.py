"""A family beyond Llama's layer served by `kvmesh up --model FILE`: a Gemma 3 GGUF (random weights
as llama.cpp's converter lays them out, a SentencePiece vocabulary whose merges the tokenizer
service recovers) streams through the gateway, tokenizer, scheduler and worker the tokens and
text the in-process engine gives for the same prompt."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvmesh.engine import Engine
from kvmesh.mesh.launcher import Mesh
from shared.config import CacheConfig, EngineConfig
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from shared.sampling import SamplingParams
from shared.text_tokenizer import load_tokenizer
from tests.e2e.mesh_helpers import (
    assert_one_terminal,
    collect,
    output_ids,
    output_text,
    text_request,
    tiny_mesh_config,
)
from tests.engine_worker.test_gguf_architectures import GEMMA3_PARTS, write_gguf_of
from tests.model_fixtures import VOCAB, save_random_checkpoint
from tests.tokenizer.test_gguf_tokenizers import sentencepiece_metadata

PROMPT = "the keeper climbed the stairs of the lighthouse and counted the waves below"


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("gemma3-gguf")
    hf_dir = save_random_checkpoint(
        directory / "hf", "gemma3", num_hidden_layers=6, query_pre_attn_scalar=32
    )
    target = directory / "gemma3.gguf"
    write_gguf_of(
        Path(hf_dir), target, "gemma3", GEMMA3_PARTS, sentencepiece_metadata("gemma3", VOCAB)
    )
    return str(target)


async def test_a_gemma3_gguf_streams_through_the_mesh(gemma3_gguf: str, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(gemma3_gguf)
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 24  # past the sliding layers' window
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=gemma3_gguf, cache=CacheConfig(kv_memory_bytes=8 << 20)))
    [expected] = engine.generate([prompt_ids], greedy)
    with Mesh(tiny_mesh_config(gemma3_gguf, str(tmp_path / "logs"))) as mesh:
        async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            events = await collect(
                stub, text_request(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
            )
    assert assert_one_terminal(events) == "completed"
    assert output_ids(events) == expected.token_ids
    assert output_text(events) == tokenizer.decode(expected.token_ids)

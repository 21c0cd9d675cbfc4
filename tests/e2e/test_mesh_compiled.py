"""A mesh whose engine-worker runs the compiled graph (`--compile auto`, as `kvmesh up` does by
default): it says so in its manifest and answers as the in-process compiled engine does."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvmesh.engine import Engine
from kvmesh.mesh.launcher import Mesh, MeshConfig
from services.engine_worker.step_formats import has_cpp_compiler
from shared.config import CacheConfig, EngineConfig
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from shared.sampling import SamplingParams
from tests.e2e.conftest import MESH_WORKER_ARGS
from tests.e2e.mesh_helpers import collect, ids_request

pytestmark = pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler")


@pytest.fixture(scope="module")
def compiled_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        worker_threads=2,
        worker_args=[*MESH_WORKER_ARGS, "--compile", "auto"],
        log_dir=str(tmp_path_factory.mktemp("compiled-mesh-logs")),
        drain_seconds=5,
    )
    with Mesh(config) as running:
        yield running


async def test_a_compiled_worker_answers_as_the_compiled_engine(compiled_mesh: Mesh) -> None:
    engine = Engine(EngineConfig(compile="auto", cache=CacheConfig(kv_memory_bytes=64 << 20)))
    assert engine.manifest["compiled"] is True
    assert engine.tokenizer is not None
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": question}])
        for question in ("Why is the sky blue?", "Name three fruits.")
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    expected = engine.generate(prompts, params)
    async with grpc.aio.insecure_channel(compiled_mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for prompt, completion in zip(prompts, expected, strict=True):
            events = await collect(stub, ids_request(prompt, max_tokens=24, temperature=0.0))
            tokens = [
                t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids
            ]
            assert tokens == completion.token_ids
    logs = glob.glob(os.path.join(compiled_mesh.log_dir, "engine-worker*.log"))
    assert logs and all('"compiled": true' in Path(path).read_text() for path in logs)

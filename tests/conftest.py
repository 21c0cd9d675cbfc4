"""Test-wide settings and the model fixtures: the default GGUF and random HF checkpoints."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# OpenMP threads that sleep when idle instead of spinning, here and in the meshes the tests
# start (they inherit it): a spinning pool waits on a thread that another process's busy loop
# holds, and the suite ran ~5x slower on a busy machine. Speed is measured by benchmarks,
# which keep the default (spinning is ~15% faster on an idle machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Engines run eager unless a test asks for the compiled graph (compile="auto"), here and in the
# meshes the tests start: a compile costs ~35 s cold, ~5 s from inductor's disk cache, per
# process and model shape. test_compiled_model.py and a mesh test run the compiled path.
os.environ.setdefault("KVMESH_COMPILE", "off")
os.environ.setdefault("KVMESH_PREPARED", "off")  # tests of prepared artifacts turn it on

import pytest
import torch

# Explicit thread counts: two OpenMP pools fighting over two cores can be 100x slower.
torch.set_num_threads(min(2, os.cpu_count() or 1))

from tests.model_fixtures import save_random_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from shared.model_paths import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: str):
    """transformers' model of the default GGUF through its own GGUF loader (~25 s: parsing the
    file's metadata and mapping its tensor names), loaded once for every module that asks."""
    from tests.engine_worker.parity import hf_model

    return hf_model(default_model_path)


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model_path: str):
    """transformers' tokenizer of the default GGUF (its own GGUF reader), loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(default_model_path), gguf_file=os.path.basename(default_model_path)
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Llama with GQA, llama3 rope scaling and untied embeddings."""
    return save_random_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Qwen2 with q/k/v biases and tied embeddings."""
    return save_random_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Qwen3: per-head q/k norms, head_dim twice hidden / heads, tied embeddings."""
    return save_random_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Phi-3: fused qkv and gate/up projections, a 256-token sliding window."""
    return save_random_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3")


@pytest.fixture(scope="session")
def tiny_phi4_mini_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Phi-4-mini-like Phi-3: half of each head rotated, LongRoPE from 256 to 1024."""
    return save_random_checkpoint(tmp_path_factory.mktemp("phi4-mini"), "phi4-mini")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Gemma 3 (text): sandwich norms, GeGLU, a 24-token window on 2 of 3 layers with
    their own RoPE base."""
    return save_random_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Gemma 2: alternate sliding layers, soft-capped attention scores and logits."""
    return save_random_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random Mistral, saved as several safetensors shards with an index."""
    return save_random_checkpoint(
        tmp_path_factory.mktemp("mistral"), "mistral", max_shard_size="300KB"
    )


@pytest.fixture
def redis_server():  # type: ignore[no-untyped-def]
    """A fresh, empty redis-server of this test's own."""
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()

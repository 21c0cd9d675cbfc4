"""`--kv-cache-dtype`: which element type the KV pool holds, and where each is refused.

The compiled step's float16 pool itself (greedy parity, perplexity, row-exactness with it) is
tested in test_compiled_model.py, where the compiled engine is."""

from __future__ import annotations

import pytest
import torch

from kvmesh.cli import build_parser as kvmesh_parser
from kvmesh.engine import Engine
from kvmesh.mesh.settings import service_args
from services.engine_worker.config import build_parser, engine_config
from services.engine_worker.kv_cache import kv_cache_dtype
from services.engine_worker.worker import Worker
from shared.config import CacheConfig, EngineConfig
from shared.errors import KvmeshError, Reason
from shared.runtime.settings import WORKER, SettingError


def test_auto_is_float16_where_the_step_compiles_else_the_activation_dtype() -> None:
    assert kv_cache_dtype(None, torch.float32, compiled=True) == torch.float16
    assert kv_cache_dtype(None, torch.float32, compiled=False) == torch.float32
    assert kv_cache_dtype(None, torch.bfloat16, compiled=False) == torch.bfloat16


def test_an_explicit_dtype_is_kept_where_the_step_compiles() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert kv_cache_dtype(dtype, torch.float32, compiled=True) == dtype
    assert kv_cache_dtype(torch.float32, torch.float32, compiled=False) == torch.float32


def test_a_pool_the_eager_step_cannot_read_is_refused_at_load(tiny_llama_dir: str) -> None:
    config = EngineConfig(
        model=tiny_llama_dir, cache=CacheConfig(kv_memory_bytes=8 << 20, dtype="float16")
    )
    with pytest.raises(KvmeshError) as caught:
        Worker(config)
    assert caught.value.reason is Reason.INVALID_ARGUMENT
    assert "--kv-cache-dtype float16 needs the compiled CPU step" in str(caught.value)


def test_an_eager_engine_keeps_its_activation_dtype_in_the_pool(tiny_llama_dir: str) -> None:
    engine = Engine(EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_memory_bytes=8 << 20)))
    manifest, arch = engine.manifest, engine.worker.architecture
    assert manifest["kv_cache_dtype"] == "float32"
    assert manifest["kv_bytes_per_token"] == arch.kv_bytes_per_token(4)
    assert engine.worker.runner.kv_cache.keys[0].dtype == torch.float32


def test_the_flag_reaches_the_config_and_a_launcher_forwards_it() -> None:
    parser = build_parser()
    args = parser.parse_args(["--kv-cache-dtype", "float32"])
    assert engine_config(args).cache.dtype == "float32"
    forwarded = service_args(
        kvmesh_parser().parse_args(["up", "--kv-cache-dtype", "float32"]), WORKER
    )
    assert forwarded[forwarded.index("--kv-cache-dtype") + 1] == "float32"
    assert engine_config(parser.parse_args([])).cache.dtype == "auto"
    with pytest.raises(SettingError):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    with pytest.raises(KvmeshError):
        CacheConfig(dtype="float8")

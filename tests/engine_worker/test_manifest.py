"""The manifest says what was loaded, from which bytes, with how much KV cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig


def test_manifest_describes_the_loaded_model(tiny_mistral_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    budget = 3 << 20
    engine = Engine(EngineConfig(model=tiny_mistral_dir, cache=CacheConfig(kv_memory_bytes=budget)))
    manifest = engine.manifest
    hf = AutoModelForCausalLM.from_pretrained(tiny_mistral_dir)
    assert manifest["architecture"] == "MistralForCausalLM"
    assert manifest["num_parameters"] == sum(p.numel() for p in hf.parameters())
    shards = sorted(Path(tiny_mistral_dir).glob("model-*.safetensors"))
    assert len(shards) > 1  # the fixture is sharded: the index path is exercised
    for shard in shards:
        assert (
            manifest["artifact_sha256"][str(shard)]
            == hashlib.sha256(shard.read_bytes()).hexdigest()
        )
    # (layers 3) x (K and V) x (2 kv heads x 16 dims) x 4 bytes
    assert manifest["kv_bytes_per_token"] == 3 * 2 * 32 * 4
    block_bytes = manifest["kv_bytes_per_token"] * manifest["kv_block_size"]
    assert manifest["kv_blocks"] == budget // block_bytes
    assert manifest["kv_cache_bytes"] == manifest["kv_blocks"] * block_bytes <= budget
    assert manifest["dtype"] == "float32" and manifest["backend"] == "torch"
    assert manifest["load_seconds"] > 0 and manifest["warmup_seconds"] > 0

"""Fixtures of the cupy backend's tests on the CPU stand-in: small random checkpoints in
shapes the GPU kernels are built for, and the stand-in itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cupy_standin import device, installed
from tests.model_fixtures import save_random_checkpoint

# head_dim 32: a size the decode kernel is built for (the shared tiny checkpoints have 16).
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        kind: save_random_checkpoint(tmp_path_factory.mktemp(kind), kind, **SHAPE)
        for kind in ("llama", "qwen2", "qwen3", "phi3", "gemma3")
    }


@pytest.fixture
def standin() -> Iterator[device.DeviceState]:
    with installed() as state:
        yield state

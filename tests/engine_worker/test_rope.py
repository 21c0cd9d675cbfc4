"""RoPE settings in both transformers spellings, and frequencies equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from services.engine_worker.artifacts.rope import RopeSpec
from shared.errors import ModelValidationError

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_v4_and_v5_spellings_give_the_same_spec() -> None:
    v4 = RopeSpec.from_hf_config({"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3)}, "c")
    v5 = RopeSpec.from_hf_config({"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}, "c")
    assert v4 == v5
    assert v4.theta == 500000.0 and v4.rope_type == "llama3" and v4.factor == 8.0


def test_llama3_frequencies_equal_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=512, num_attention_heads=8, rope_theta=500000.0, rope_scaling=dict(LLAMA3)
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    spec = RopeSpec.from_hf_config(config.to_dict(), "c")
    assert torch.equal(spec.inv_freq(64), expected)


def test_longrope_short_range_and_partial_rotary_equal_transformers() -> None:
    """Phi-4-mini's rotary: 3/4 of a 128-dim head, short factors and the attention factor."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short = [1.0 + i / 8 for i in range(48)]
    config = Phi3Config(
        hidden_size=3072,
        num_attention_heads=24,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": [4.0] * 48},
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    spec = RopeSpec.from_hf_config(config.to_dict(), "c")
    assert spec.rotary_dim(128) == 96 and torch.equal(spec.inv_freq(128), expected)
    assert spec.attention_factor == pytest.approx(attention_factor) and attention_factor > 1
    cos, sin = spec.cos_sin(128, 8, torch.float32)
    assert torch.equal(cos[:, 96:], torch.ones(8, 32)) and torch.equal(
        sin[:, 96:], torch.zeros(8, 32)
    )


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ModelValidationError, match="unsupported rope_type"):
        RopeSpec.from_hf_config(
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "config.json"
        )

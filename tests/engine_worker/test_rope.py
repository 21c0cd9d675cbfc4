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


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ModelValidationError, match="unsupported rope_type"):
        RopeSpec.from_hf_config(
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "config.json"
        )

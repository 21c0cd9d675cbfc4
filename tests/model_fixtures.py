"""Small random-weight checkpoints written by transformers itself, in its own format."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def save_random_checkpoint(
    directory: Path,
    kind: str,
    seed: int = 0,
    max_shard_size: str = "1GB",
    **overrides: float,
) -> str:
    """overrides: config values in place of the small defaults below (e.g. a head_dim the
    GPU kernels take: hidden_size / num_attention_heads of 32, 64 or 128)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if kind == "llama":
        config = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=10000.0,
        )
        model_class = LlamaForCausalLM
    elif kind == "llama-plain":  # default RoPE: what a GGUF file can describe
        config = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model_class = LlamaForCausalLM
    elif kind == "mistral":
        config = MistralConfig(
            **common, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None
        )
        model_class = MistralForCausalLM
    elif kind == "qwen3":  # per-head q/k norms; head_dim apart from hidden / heads
        config = Qwen3Config(
            **{"head_dim": 2 * common["hidden_size"] // common["num_attention_heads"], **common},
            tie_word_embeddings=True,
            rope_theta=1_000_000.0,
        )
        model_class = Qwen3ForCausalLM
    elif kind == "phi3":  # fused qkv_proj and gate_up_proj; a window under the context
        config = Phi3Config(
            **common, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=256
        )
        model_class = Phi3ForCausalLM
    elif kind == "phi4-mini":  # Phi-4-mini's rotary: half of each head, LongRoPE to 4x
        common["max_position_embeddings"] = 1024
        config = Phi3Config(
            **common,
            tie_word_embeddings=True,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=256,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.5, 4.0],
                "long_factor": [4.0, 8.0, 16.0, 32.0],
            },
            rope_theta=10000.0,
        )
        model_class = Phi3ForCausalLM
    elif kind == "gemma3":  # 2 sliding layers of 3 with their own RoPE, q/k norms
        gemma3 = dict(
            head_dim=32,
            sliding_window=24,
            sliding_window_pattern=3,
            query_pre_attn_scalar=24,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
        )
        config = Gemma3TextConfig(**{**gemma3, **common})
        model_class = Gemma3ForCausalLM
    elif kind == "gemma2":  # alternate sliding layers, soft-capped scores and logits
        gemma2 = dict(
            head_dim=16,
            sliding_window=24,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        )
        config = Gemma2Config(**{**gemma2, **common})
        model_class = Gemma2ForCausalLM
    else:
        config = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000.0)
        model_class = Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        # Wider weights than the default init give peaked next-token distributions, so greedy
        # choices are decided by the model rather than by float rounding.
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # a wrong head's shows
                param.uniform_(0.5, 1.5)
            elif kind.startswith("gemma"):  # zero-centred: a missed (1 + w) shows
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    return str(directory)

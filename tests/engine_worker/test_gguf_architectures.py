"""Qwen2, Qwen3, Mistral and Phi-3 GGUFs as llama.cpp's converter writes them (Q and K rows
interleaved for Llama's architecture only, which Mistral's checkpoints are written as; Qwen2's
Q/K/V biases; Qwen3's `attn_q_norm` / `attn_k_norm` and head_dim as `key_length`; Phi-3's fused
`attn_qkv` and `ffn_up`, its sliding window) against transformers on the checkpoint each was
written from."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.engine_worker.artifacts.gguf_file import GGUFArtifact, hf_name
from shared.errors import ModelValidationError
from tests.engine_worker.parity import assert_mostly_matches, kvmesh_greedy, transformers_greedy

_LAYER_PARTS = (
    "attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
    "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip
_PHI3_PARTS = ("attn_norm", "ffn_norm", "attn_qkv", "attn_output", "ffn_up", "ffn_down")
GEMMA2_PARTS = (
    "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q", "attn_k", "attn_v",
    "attn_output", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip
GEMMA3_PARTS = (*GEMMA2_PARTS, "attn_q_norm", "attn_k_norm")


def all_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, one file or sharded."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def write_gguf_of(
    hf_dir: Path,
    target: Path,
    arch: str = "qwen3",
    parts: tuple[str, ...] = _LAYER_PARTS,
    extra: Callable[[Any], None] | None = None,
) -> None:
    """`extra(writer)`: writes more (a tokenizer's metadata, LongRoPE's); else the EOS id."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = all_tensors(hf_dir)
    writer = gguf.GGUFWriter(str(target), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3 keys its RoPE by layer kind
    writer.add_rope_freq_base(config.get("rope_theta") or rope["rope_theta"])
    gemma = arch.startswith("gemma")
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_vocab_size(config["vocab_size"])
    if extra is not None:
        extra(writer)
    else:
        writer.add_eos_token_id(config["eos_token_id"])
    names = ["token_embd.weight", "output_norm.weight"]
    if not config["tie_word_embeddings"]:
        names.append("output.weight")
    for i in range(config["num_hidden_layers"]):
        names += [f"blk.{i}.{part}.weight" for part in parts]
    for name in names:
        tensor = tensors[hf_name(name, fused=arch == "phi3", sandwich=gemma)]  # type: ignore[index]
        if gemma and "norm" in name:  # llama.cpp's converter stores Gemma's 1 + w
            tensor = tensor.float() + 1
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "checkpoint, arch, parts",
    [("tiny_qwen3_dir", "qwen3", _LAYER_PARTS), ("tiny_phi3_dir", "phi3", _PHI3_PARTS)],
)
def test_a_gguf_matches_transformers(
    checkpoint: str,
    arch: str,
    parts: tuple[str, ...],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    from transformers import AutoModelForCausalLM

    hf_dir = request.getfixturevalue(checkpoint)
    target = tmp_path / f"{arch}.gguf"
    write_gguf_of(Path(hf_dir), target, arch, parts)
    prompts = [[5, 9, 200, 17], list(range(3, 60)), [44] * 20, list(range(100, 300, 7))]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    expected = transformers_greedy(model, prompts, 16, eos=2)
    ours, engine = kvmesh_greedy(str(target), prompts, 16)
    assert engine.manifest["architecture"] == model.config.architectures[0]
    # Phi-3's 256-token window caps the context served (every layer attends to all of it).
    assert engine.worker.max_model_len == (256 if arch == "phi3" else 1024)
    assert_mostly_matches(ours, expected)


def _interleaved(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's `permute` for Llama's Q and K: each head's halves interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2)


@pytest.mark.parametrize("checkpoint", ["tiny_qwen2_dir", "tiny_mistral_dir"])
def test_qwen2_and_mistral_ggufs_match_transformers(
    checkpoint: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Qwen2 with its biases; Mistral as the converter writes it, a `llama` GGUF."""
    from transformers import AutoModelForCausalLM

    hf_dir = Path(request.getfixturevalue(checkpoint))
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = all_tensors(hf_dir)
    qwen2 = checkpoint == "tiny_qwen2_dir"
    heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}

    def projections(writer: Any) -> None:
        writer.add_eos_token_id(config["eos_token_id"])
        for i in range(config["num_hidden_layers"]):
            for part in ("q", "k", "v") if qwen2 else ("q", "k"):
                for kind in ("weight", "bias") if qwen2 else ("weight",):
                    tensor = tensors[f"model.layers.{i}.self_attn.{part}_proj.{kind}"].float()
                    if not qwen2:
                        tensor = _interleaved(tensor, heads[part]).reshape(tensor.shape)
                    writer.add_tensor(f"blk.{i}.attn_{part}.{kind}", tensor.numpy())

    skipped = ("attn_q", "attn_k", "attn_v") if qwen2 else ("attn_q", "attn_k")
    parts = tuple(p for p in _LAYER_PARTS if p not in (*skipped, "attn_q_norm", "attn_k_norm"))
    target = tmp_path / "model.gguf"
    write_gguf_of(hf_dir, target, "qwen2" if qwen2 else "llama", parts, projections)
    prompts = [[5, 9, 200, 17], list(range(3, 60)), [44] * 20, list(range(100, 300, 7))]
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    expected = transformers_greedy(model, prompts, 16, eos=2)
    ours, engine = kvmesh_greedy(str(target), prompts, 16)
    name = "Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"
    assert engine.manifest["architecture"] == name
    assert_mostly_matches(ours, expected)


def test_a_phi4_mini_gguf_matches_transformers(tiny_phi4_mini_dir: str, tmp_path: Path) -> None:
    """Phi-4-mini as llama.cpp's converter writes it: the rotated dimensions as
    `rope.dimension_count`, LongRoPE's factors as tensors, its attention factor and original
    context in the metadata; served within that context."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(tiny_phi4_mini_dir) / "config.json").read_text())
    rope = config["rope_parameters"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    original = rope["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original

    def longrope(writer: Any) -> None:
        writer.add_eos_token_id(config["eos_token_id"])
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        for kind in ("short", "long"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)

    target = tmp_path / "phi4-mini.gguf"
    write_gguf_of(Path(tiny_phi4_mini_dir), target, "phi3", _PHI3_PARTS, longrope)
    prompts = [[5, 9, 200, 17], list(range(3, 60)), [44] * 20, list(range(100, 300, 7))]
    model = AutoModelForCausalLM.from_pretrained(tiny_phi4_mini_dir, dtype=torch.float32).eval()
    expected = transformers_greedy(model, prompts, 16, eos=2)
    ours, engine = kvmesh_greedy(str(target), prompts, 16)
    assert engine.worker.max_model_len == original
    rope_spec = engine.worker.architecture.rope
    assert rope_spec.rope_type == "longrope" and rope_spec.partial == 0.5
    assert_mostly_matches(ours, expected)


def test_a_qwen3_gguf_without_its_k_norms_is_refused_by_name(
    tiny_qwen3_dir: str, tmp_path: Path
) -> None:
    target = tmp_path / "qwen3.gguf"
    without = tuple(p for p in _LAYER_PARTS if p != "attn_k_norm")
    write_gguf_of(Path(tiny_qwen3_dir), target, "qwen3", without)
    with pytest.raises(ModelValidationError) as refused:
        GGUFArtifact(str(target)).validate()
    assert "missing tensor" in str(refused.value)
    assert refused.value.tensor == "model.layers.0.self_attn.k_norm.weight"

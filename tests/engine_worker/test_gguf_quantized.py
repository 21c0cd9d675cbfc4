"""GGUF reading end to end on a file we write: every supported tensor type, llama.cpp's Q/K row
permutation, and metadata, checked against transformers on the same (dequantized) weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine_worker.artifacts.gguf_file import K_QUANT_TYPES, hf_name
from services.engine_worker.artifacts.rope import RopeSpec
from tests.engine_worker.parity import assert_mostly_matches, kvmesh_greedy, transformers_greedy
from tests.model_fixtures import save_random_checkpoint

LAYER_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "F16",
    "ffn_gate": "Q8_0",
    "ffn_up": "BF16",
    "ffn_down": "Q4_1",
}


def gguf_names(num_layers: int) -> dict[str, str]:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(num_layers):
        names += [f"blk.{i}.{part}.weight" for part in [*LAYER_TYPES, "attn_norm", "ffn_norm"]]
    return {hf_name(n): n for n in names}  # type: ignore[misc]


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


# Where a K-quant block keeps its fp16 super-block scale d (and dmin, 2 bytes on), and the
# dmin / d ratio that centres its values on 0 (None: no dmin, the values are symmetric).
_K_SCALES = {
    "Q2_K": (80, 1.5),
    "Q3_K": (108, None),
    "Q4_K": (0, 7.5),
    "Q5_K": (0, 15.5),
    "Q6_K": (208, None),
}


def random_k_blocks(shape: tuple[int, ...], kind: str, seed: int, std: float = 0.1) -> np.ndarray:
    """A K-quant tensor of random blocks whose values have about `std`: random quants and
    sub-block scales under one super-block scale, chosen after a first pass with d = 1."""
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[kind]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    at, dmin_ratio = _K_SCALES[kind]

    def set_scale(d: float) -> None:
        blocks[..., at : at + 2] = np.array([d], np.float16).view(np.uint8)
        if dmin_ratio is not None:
            blocks[..., at + 2 : at + 4] = np.array([d * dmin_ratio], np.float16).view(np.uint8)

    set_scale(1.0)
    unit = float(quants.dequantize(blocks.reshape(rows, -1), qtype).std())
    set_scale(std / unit)
    return blocks.reshape(rows, -1)


def write_gguf(
    hf_dir: Path,
    target: Path,
    reference_dir: Path,
    layer_types: dict[str, str] = LAYER_TYPES,
    embed_type: str = "Q8_0",
) -> None:
    """`target`: a GGUF of hf_dir's weights; `reference_dir`: an HF copy of exactly the weights
    the GGUF holds after quantization, for transformers to run."""
    import gguf
    from gguf import quants

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(RopeSpec.from_hf_config(config, "config.json").theta)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    reference = {}
    for name, gguf_name in gguf_names(config["num_hidden_layers"]).items():
        weight = tensors[name].numpy()
        part = gguf_name.split(".")[-2]
        kind = layer_types.get(part, embed_type if part in ("token_embd", "output") else "F32")
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        stored = llama_cpp_permute(weight, heads[part]) if part in heads else weight
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in K_QUANT_TYPES:  # no quantizer in the gguf package: random blocks
            data = random_k_blocks(stored.shape, kind, seed=len(reference))  # one per tensor
        else:
            data = stored if kind == "F32" else quants.quantize(stored, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        exact = torch.from_numpy(
            np.ascontiguousarray(quants.dequantize(data, qtype), dtype=np.float32)
        )
        if part in heads:  # undo the permutation: the reference is in transformers' layout
            rows = exact.shape[0]
            exact = exact.reshape(heads[part], rows // heads[part] // 2, 2, -1).transpose(1, 2)
        reference[name] = exact.reshape(weight.shape).contiguous()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copy(hf_dir / "config.json", reference_dir / "config.json")
    save_file(reference, str(reference_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf_dir = Path(save_random_checkpoint(tmp_path_factory.mktemp("plain"), "llama-plain", seed=3))
    reference_dir = tmp_path_factory.mktemp("reference")
    target = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(hf_dir, target, reference_dir)
    return target, reference_dir


def test_quantized_gguf_matches_transformers_on_the_same_weights(
    quantized: tuple[Path, Path],
) -> None:
    from transformers import AutoModelForCausalLM

    target, reference_dir = quantized
    prompts = [[5, 9, 200, 17], list(range(3, 60)), [44] * 20, list(range(100, 300, 7))]
    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    expected = transformers_greedy(model, prompts, 16, eos=2)
    ours, engine = kvmesh_greedy(str(target), prompts, 16)
    assert_mostly_matches(ours, expected)
    manifest = engine.manifest
    assert manifest["quantization"] == "BF16+F16+F32+Q4_0+Q4_1+Q8_0"
    assert manifest["architecture"] == "LlamaForCausalLM"

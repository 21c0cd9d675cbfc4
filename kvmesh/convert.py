"""`kvmesh convert`: a model artifact rewritten as an F32 GGUF or an HF safetensors directory.

GGUF -> GGUF copies every metadata key and dequantizes every tensor to F32, in llama.cpp's own
tensor layout: the same weights at full precision, for an equal-precision comparison with
llama.cpp. Any input -> safetensors writes the HF layout the loader validates (the GGUF's Q/K
rows un-permuted), a config.json, and the tokenizer with its chat template.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy

from shared.model_paths import resolve_model_path
from shared.text_tokenizer import load_tokenizer

_SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type")
_MODEL_TYPES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
_ALL_F32 = 0  # llama.cpp's LLAMA_FTYPE_ALL_F32


def copy_gguf_metadata(reader: Any, writer: Any, skipped: tuple[str, ...] = _SKIPPED_KEYS) -> None:
    """Every metadata key of a GGUFReader into a GGUFWriter, but those starting with `skipped`
    (the writer sets the architecture; a converted file has its own type)."""
    import gguf

    for key, field in reader.fields.items():
        if key.startswith(skipped):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)


def gguf_to_f32(source: str, target: str) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    copy_gguf_metadata(reader, writer)
    writer.add_file_type(_ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(numpy.float32)
        writer.add_tensor(tensor.name, values.reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def to_safetensors(source: str, target_dir: str) -> None:
    from safetensors.torch import save_file

    # here, not at the top: every `kvmesh` command imports this module, and these import torch
    from services.engine_worker.artifacts.decoder_style import GEMMA_ARCHITECTURES
    from services.engine_worker.artifacts.loader import open_artifact
    from services.engine_worker.artifacts.weights import expected_tensors

    artifact = open_artifact(source)
    artifact.validate()
    arch = artifact.architecture
    gemma = arch.name in GEMMA_ARCHITECTURES
    if not (arch.llama_layer or gemma):  # a config.json that would not say its LongRoPE
        raise SystemExit(f"kvmesh convert: {arch.name} is not written as safetensors yet")
    required, _ = expected_tensors(arch)
    os.makedirs(target_dir, exist_ok=True)
    tensors = {name: artifact.load(name).float().contiguous() for name in required}
    if gemma:  # transformers' Gemma norms hold w and scale by 1 + w; a GGUF holds 1 + w
        for name in tensors:
            if "norm" in name:
                tensors[name] += arch.style.norm_offset - 1.0
    save_file(tensors, os.path.join(target_dir, "model.safetensors"))
    config = {
        "architectures": [arch.name],
        "model_type": _MODEL_TYPES.get(arch.name, "llama"),
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "rope_theta": arch.rope.theta,
        "torch_dtype": "float32",
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": list(arch.eos_token_ids) or None,
        "pad_token_id": None,  # a family's default may lie past a small vocabulary (Phi-3's)
    }
    if arch.rope.rope_type != "default":
        config["rope_scaling"] = {
            "rope_type": arch.rope.rope_type,
            "factor": arch.rope.factor,
            "low_freq_factor": arch.rope.low_freq_factor,
            "high_freq_factor": arch.rope.high_freq_factor,
            "original_max_position_embeddings": arch.rope.original_max_position_embeddings,
        }
    if gemma:
        config.update(_gemma_config(arch))
    Path(target_dir, "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.tokenizer.save(os.path.join(target_dir, "tokenizer.json"))
        settings = {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "add_bos_token": tokenizer.add_bos,
            "chat_template": tokenizer.chat_template,
        }
        Path(target_dir, "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def _gemma_config(arch: Any) -> dict[str, Any]:
    """What a Gemma config.json says beyond Llama's: the layer kinds and window, the query
    scale, the soft-caps and Gemma 3's local RoPE base."""
    style = arch.style
    layer_types = [
        "sliding_attention" if i in style.sliding_layers else "full_attention"
        for i in range(arch.num_layers)
    ]
    config = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": round(style.attention_scale**-2),  # an int in transformers
        "sliding_window": style.sliding_window,
        "layer_types": layer_types,
        "attn_logit_softcapping": style.attn_softcap,
        "final_logit_softcapping": style.final_softcap,
    }
    if style.local_rope is not None:
        config["rope_local_base_freq"] = style.local_rope.theta
    return config


def add_convert_parser(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert", help="rewrite a model as an F32 GGUF or an HF safetensors directory"
    )
    convert.add_argument("target", help="a .gguf file (F32) or a directory (safetensors)")
    convert.add_argument("--model", help="the input (default: SmolLM2-135M-Instruct)")


def run_convert(args: argparse.Namespace) -> int:
    source = resolve_model_path(args.model)
    if args.target.endswith(".gguf"):
        if not source.endswith(".gguf"):
            raise SystemExit("kvmesh convert: an F32 GGUF is written from a GGUF input")
        gguf_to_f32(source, args.target)
    else:
        to_safetensors(source, args.target)
    print(args.target)
    return 0

"""GGUF files through the `gguf` package: metadata, tensor validation, dequantization.

llama.cpp's converter permutes the rows of Q and K for its interleaved rotary; we undo that so
one rotary (transformers' rotate_half) serves every format.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.int4_groups import INT4_BLOCK_TYPES, Int4Groups
from services.engine_worker.artifacts.weights import validate_tensor_table
from shared.errors import ModelValidationError

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# LongRoPE's per-frequency divisors (Phi-3 128k, Phi-4-mini): short, then long.
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# K-quants are what GGUF publishers ship (Q4_K_M mixes Q4_K and Q6_K tensors). A row whose
# length is not a multiple of their 256-value blocks falls back to Q5_0, Q5_1 or Q8_0 (llama-
# quantize's choice): SmolLM2-135M's 576-wide rows make most of its Q4_K_M file Q5_0.
K_QUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BLOCK_QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # 32 values a block
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", *BLOCK_QUANT_TYPES, *K_QUANT_TYPES)
# Big arrays are read by the tokenizer, not needed to describe the model.
_SKIPPED_METADATA = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


# Phi-3's fused projections: Q, K, V in one tensor, gate and up in `ffn_up`.
_FUSED_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}


# Gemma's four norms a layer: `ffn_norm` is its pre-MLP norm, the outputs' norms their own.
_SANDWICH_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def hf_name(gguf_name: str, fused: bool = False, sandwich: bool = False) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _FUSED_LAYER_NAMES if fused else _SANDWICH_LAYER_NAMES if sandwich else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


# An array this long is a tokenizer's vocabulary, merges, scores or token types: only its
# length is read here.
_LONG_ARRAY = 4096


def _metadata_reader(gguf: Any) -> type:
    """`GGUFReader`, keeping each long array as one block of bytes: the stock reader parses
    arrays element by element, and the default model's 147k tokenizer entries took 1 s of a
    1.1 s open (the tokenizer service reads them with its own reader). The block's `data` has
    one index per element, so the array's length reads right; its `contents()` do not."""
    import struct

    class MetadataReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
            if raw_type != array or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = self._get(orig_offs, np.uint32)
            length = self._get(orig_offs + 4, np.uint64)
            scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item_type[0]))
            if length[0] < _LONG_ARRAY or (scalar is None and item_type[0] != string):
                return super()._get_field_parts(orig_offs, raw_type)
            offset = orig_offs + 12
            if scalar is not None:
                offset += int(length[0]) * np.dtype(scalar).itemsize
            else:
                view = memoryview(self.data)
                for _ in range(int(length[0])):  # each string: a u64 byte count, the bytes
                    offset += 8 + struct.unpack_from("<Q", view, offset)[0]
            block = self.data[orig_offs + 12 : offset]
            indices = [2] * int(length[0])
            item = gguf.GGUFValueType(item_type[0])
            return offset - orig_offs, [item_type, length, block], indices, [array, item]

    return MetadataReader


class GGUFArtifact:
    """Opens and validates a GGUF file; tensors are dequantized only when loaded."""

    def __init__(self, path: str) -> None:
        import gguf  # lazy: only GGUF users pay for it

        self.path = path
        self.file_size = os.path.getsize(path)
        try:
            self.reader = _metadata_reader(gguf)(path)
        except Exception as error:  # the reader raises bare ValueError/IndexError on bad bytes
            raise ModelValidationError(
                path, f"not a readable GGUF file ({type(error).__name__}: {error})"
            ) from None
        self.metadata = self._read_metadata()
        has_output = any(t.name == "output.weight" for t in self.reader.tensors)
        self.architecture = ModelArchitecture.from_gguf_metadata(self.metadata, path, has_output)
        self.tensors = {}
        unknown = []
        arch = self.architecture
        rope_factors = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name, arch.fused_projections, arch.style.sandwich_norms)
            if tensor.name in _ROPE_FACTORS:
                rope_factors[tensor.name] = tensor
            elif name is None:
                unknown.append(tensor.name)
            else:
                self.tensors[name] = tensor
        if unknown:
            raise ModelValidationError(path, "unexpected tensor", tensor=unknown[0])
        if _ROPE_FACTORS[0] in rope_factors:  # served within the original context: short ones
            short = np.asarray(rope_factors[_ROPE_FACTORS[0]].data, dtype=np.float32).tolist()
            rope = arch.rope.with_gguf_longrope(
                self.metadata, self.metadata["general.architecture"], short
            )
            self.architecture = dataclasses.replace(
                arch,
                rope=rope,
                max_position_embeddings=min(
                    arch.max_position_embeddings, rope.original_max_position_embeddings
                ),
            )

    def _read_metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key in _SKIPPED_METADATA or len(field.data) >= _LONG_ARRAY:
                meta[key] = range(len(field.data))  # only the length is used here
            else:
                meta[key] = field.contents()
        return meta

    @property
    def quantization(self) -> str:
        kinds = sorted({t.tensor_type.name for t in self.tensors.values()})
        return "+".join(kinds)

    def validate(self) -> None:
        for name, tensor in self.tensors.items():
            kind = tensor.tensor_type.name
            if kind not in SUPPORTED_QUANT_TYPES:
                raise ModelValidationError(
                    self.path,
                    "unsupported quantization type",
                    tensor=name,
                    expected=list(SUPPORTED_QUANT_TYPES),
                    found=kind,
                )
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > self.file_size:
                raise ModelValidationError(
                    self.path,
                    "file is truncated",
                    tensor=name,
                    expected=f">= {end} bytes",
                    found=f"{self.file_size} bytes",
                )
        shapes = {
            name: tuple(int(d) for d in reversed(t.shape)) for name, t in self.tensors.items()
        }
        validate_tensor_table(self.path, self.architecture, shapes)

    def load(self, name: str) -> torch.Tensor:
        """Dequantized float32 tensor in HF layout."""
        from gguf import quants

        tensor = self.tensors[name]
        array = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not array.flags.writeable:  # F32 tensors come back as the read-only file mapping
            array = array.copy()
        result = torch.from_numpy(array.reshape(tuple(int(d) for d in reversed(tensor.shape))))
        heads = self._permuted_heads(name)
        return result if heads is None else result[_unpermuted_order(result.shape[0], heads)]

    def load_int4(self, name: str) -> Int4Groups | None:
        """A Q4_0/Q4_1/Q4_K tensor's own nibbles and group scales in HF layout; None for others."""
        tensor = self.tensors[name]
        kind = tensor.tensor_type.name
        if kind not in INT4_BLOCK_TYPES:
            return None
        rows, cols = (int(d) for d in reversed(tensor.shape))
        groups = Int4Groups.from_blocks(tensor.data, kind, (rows, cols))
        heads = self._permuted_heads(name)
        return groups if heads is None else groups.rows(_unpermuted_order(rows, heads))

    def _permuted_heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp's converter interleaved, for Q and K."""
        arch = self.architecture
        if arch.name not in ("LlamaForCausalLM", "MistralForCausalLM"):
            return None  # llama.cpp's converter interleaves Llama's and Mistral's rows only
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return arch.num_heads
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return arch.num_kv_heads
        return None


def _unpermuted_order(rows: int, num_heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's interleave: it stores each head's rows as pairs
    (i, i + d/2); this gives transformers' halves order."""
    head_dim = rows // num_heads
    return torch.arange(rows).view(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(rows)

"""The torch backend's weights in the format in force: float32, bfloat16, or packed int8.

Built from the loaded `ModelWeights` (fused, (in, out) float tensors, which the cupy backend
uses as they are) one layer at a time, so the float copy of a packed model is never whole in
memory beside the packed one for longer than a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine_worker.linear import (
    DenseLinear,
    InputScratch,
    Int8Linear,
    Projection,
    quantize_rows,
)
from services.engine_worker.weights import ModelWeights
from shared.config import WEIGHT_FORMATS

_FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_weight_format(requested: str, quantize: str | None) -> str:
    """`auto`: float32, unless --quantize asks for packed weights (EngineConfig has checked
    that the two agree).

    Packed stays opt-in, for quantized GGUFs too: its int8 rounding turns the float-level
    difference between a cold prefill and one over a cached prefix into different tokens now and
    then, so a seeded request would not always reproduce across prefix-cache states (the mesh
    tests caught it). Until prefill is bit-identical whatever the cache holds, the default is the
    path that computes the file's dequantized weights as transformers does.
    """
    if requested != "auto":
        return requested
    return "packed" if quantize is not None else "float32"


class DenseEmbedding:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # (vocab, hidden)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table)

    @property
    def resident_bytes(self) -> int:
        return self.table.numel() * self.table.element_size()


class Int8Embedding:
    """Rows as int8 with one scale each: a lookup dequantizes only the rows it reads."""

    def __init__(self, table: torch.Tensor) -> None:
        self.rows, self.scale = quantize_rows(table)  # (vocab, hidden) int8, (vocab, 1)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.rows).float().mul_(F.embedding(ids, self.scale))

    @property
    def resident_bytes(self) -> int:
        return self.rows.numel() + self.scale.numel() * 4


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class TorchLayer:
    input_norm: torch.Tensor  # (hidden,)
    qkv: Projection  # hidden -> q_size + 2 * kv_size
    o_proj: Projection  # q_size -> hidden
    post_norm: torch.Tensor
    gate_up: Projection  # hidden -> 2 * intermediate (gate, then up)
    down: Projection  # intermediate -> hidden


@dataclass(frozen=True)
class TorchWeights:
    format: str
    embed: DenseEmbedding | Int8Embedding
    layers: tuple[TorchLayer, ...]
    final_norm: torch.Tensor
    lm_head: Projection
    head_is_embedding: bool = False  # a tied float head runs on the embedding table

    @property
    def resident_bytes(self) -> int:
        """Bytes the weights keep in memory (a tied dense head is the embedding table itself)."""
        total = self.embed.resident_bytes + _nbytes(self.final_norm)
        if not self.head_is_embedding:
            total += self.lm_head.resident_bytes
        for layer in self.layers:
            total += sum(
                p.resident_bytes for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            )
            total += _nbytes(layer.input_norm) + _nbytes(layer.post_norm)
        return total

    @staticmethod
    def from_float(weights: ModelWeights, fmt: str, compute_dtype: torch.dtype) -> TorchWeights:
        """Projections in `fmt`; norms (and a dense embedding) in the compute dtype."""
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(fmt)
        dtype = _FLOAT_FORMATS.get(fmt, torch.float32)  # packed: quantized from float32
        scratch = InputScratch()  # one set of fbgemm input buffers for the whole model
        if fmt != "packed" and compute_dtype != torch.float32:
            dtype = compute_dtype  # float16/bfloat16 activations run same-dtype weights

        def projection(transposed: torch.Tensor, bias: torch.Tensor | None) -> Projection:
            weight = transposed.t()  # (out, in)
            if fmt == "packed":
                return Int8Linear(weight, bias, scratch=scratch)
            return DenseLinear(weight.to(dtype).contiguous(), bias)

        layers = []
        for layer in weights.layers:
            layers.append(
                TorchLayer(
                    input_norm=layer.input_norm.to(compute_dtype),
                    qkv=projection(layer.qkv, layer.qkv_bias),
                    o_proj=projection(layer.o_proj, layer.o_bias),
                    post_norm=layer.post_norm.to(compute_dtype),
                    gate_up=projection(layer.gate_up, None),
                    down=projection(layer.down, None),
                )
            )
        embed: DenseEmbedding | Int8Embedding
        lm_head: Projection
        if fmt == "packed":
            embed = Int8Embedding(weights.embed)
            lm_head = Int8Linear(weights.lm_head.t(), scratch=scratch)
        else:
            table = weights.embed.to(dtype)
            embed = DenseEmbedding(table)
            head = table if weights.tied else weights.lm_head.t().to(dtype).contiguous()
            lm_head = DenseLinear(head)
        final_norm = weights.final_norm.to(compute_dtype)
        head_is_embedding = fmt != "packed" and weights.tied
        return TorchWeights(fmt, embed, tuple(layers), final_norm, lm_head, head_is_embedding)

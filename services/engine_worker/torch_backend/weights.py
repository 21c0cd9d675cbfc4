"""The torch backend's weights in the format in force: float32, bfloat16, float16, or packed
(4-bit groups where the CPU runs them fast: `kvmesh::int4_dot` on AVX-512 and AVX2 CPUs, torch's
kernel on AVX-512 where ours cannot build; int8 rows elsewhere and for the head, through
`kvmesh::int8_dot` with AVX512-VNNI, else fbgemm).

Built from the loaded `ModelWeights` (fused, (in, out) float tensors, which the cupy backend
uses as they are) one layer at a time, so the float copy of a packed model is never whole in
memory beside the packed one for longer than a layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine_worker.artifacts.gguf_file import BLOCK_QUANT_TYPES, K_QUANT_TYPES
from services.engine_worker.artifacts.int4_groups import Int4Groups
from services.engine_worker.artifacts.loader import ModelArtifact
from services.engine_worker.artifacts.weights import ModelWeights, projection_names
from services.engine_worker.torch_backend import dot_kernels
from services.engine_worker.torch_backend.int4_dot import (
    Int4DotLinear,
    fits,
    int4_dot_is_available,
)
from services.engine_worker.torch_backend.int8_dot import Int8DotLinear, int8_dot_is_available
from services.engine_worker.torch_backend.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Projection,
    int4_kernel_is_fast,
    quantize_rows,
)
from shared.config import WEIGHT_FORMATS

# A packed projection's HF tensor names and fused float (out, in) weight -> its 4-bit groups (a
# Q4 file's own blocks, or quantized at load), or None: it then runs as int8 rows.
Int4Source = Callable[[tuple[str, ...], torch.Tensor], Int4Groups | None]

QUANTIZED_TYPES = (*BLOCK_QUANT_TYPES, *K_QUANT_TYPES)
_FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_weight_format(requested: str, quantize: str | None, quantization: str) -> str:
    """`auto`: packed for a quantized file (Q4_0 to Q8_0 or K-quant tensors) or when
    --quantize asks for it (EngineConfig has checked that the two agree); float32 otherwise.
    `quantization` is the artifact's tensor types, e.g. "F32+Q4_1+Q8_0".

    Packed activations are rounded (to bfloat16 for 4-bit groups, per token to int8 rows), so a
    float-level difference upstream can move a value a whole rounding step. Both kernels compute
    a row the same whatever its batch, and prefill attention gives a cached prefix's queries the
    bits a cold prefill gives (`prefill_attention`), so a seeded request still reproduces across
    prefix-cache states (tested); before that, packed had to stay opt-in.
    """
    if requested != "auto":
        return requested
    quantized = any(kind in quantization.split("+") for kind in QUANTIZED_TYPES)
    return "packed" if quantize is not None or quantized else "float32"


def int4_source(artifact: ModelArtifact, quantize: str | None) -> Int4Source | None:
    """Where packed projections get 4-bit groups: `--quantize int4` quantizes each projection's
    float weight at load; otherwise a GGUF's Q4_0/Q4_1/Q4_K tensors bring their own (`--quantize
    int8` asks for int8 rows throughout). None where this CPU has no fast 4-bit kernel (neither
    ours, AVX-512 or AVX2, nor torch's, AVX-512)."""
    if not (int4_dot_is_available() or int4_kernel_is_fast()) or quantize == "int8":
        return None
    if quantize == "int4":  # rows are independent: the fused weight quantizes as its parts
        return lambda names, weight: Int4Groups.quantize(weight)

    def files_groups(names: tuple[str, ...], weight: torch.Tensor) -> Int4Groups | None:
        parts = [artifact.load_int4(name) for name in names]
        present = [part for part in parts if part is not None]
        return Int4Groups.cat(present) if len(present) == len(parts) else None

    return files_groups


def packed_rows(
    weight: torch.Tensor, bias: torch.Tensor | None = None
) -> Int8Linear | Int8DotLinear:
    """(out, in) float -> int8 rows: through our kernel where it runs (VNNI), else fbgemm."""
    out_features, in_features = weight.shape
    if int8_dot_is_available() and dot_kernels.fits(out_features, in_features):
        return Int8DotLinear(*quantize_rows(weight), bias)
    return Int8Linear(weight, bias)


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

    @classmethod
    def from_rows(cls, rows: torch.Tensor, scale: torch.Tensor) -> Int8Embedding:
        embedding = cls.__new__(cls)
        embedding.rows, embedding.scale = rows, scale
        return embedding

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
    qk_norm: torch.Tensor | None = None  # (heads + kv_heads, head_dim), as LayerWeights'
    attn_out_norm: torch.Tensor | None = None  # Gemma's, as LayerWeights'
    mlp_out_norm: torch.Tensor | None = None

    @property
    def norms(self) -> dict[str, torch.Tensor]:
        """Every norm weight the layer has, by field name."""
        names = ("input_norm", "post_norm", "qk_norm", "attn_out_norm", "mlp_out_norm")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


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
            total += sum(_nbytes(norm) for norm in layer.norms.values())
        return total

    @staticmethod
    def from_float(
        weights: ModelWeights,
        fmt: str,
        compute_dtype: torch.dtype,
        int4: Int4Source | None = None,
    ) -> TorchWeights:
        """Projections in `fmt`; norms (and a dense embedding) in the compute dtype. Packed
        projections run on their 4-bit groups when `int4` has them for every part, else as
        int8 rows quantized from the float weight."""
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(fmt)
        dtype = _FLOAT_FORMATS.get(fmt, torch.float32)  # packed: quantized from float32
        if fmt != "packed" and compute_dtype != torch.float32:
            dtype = compute_dtype  # float16/bfloat16 activations run same-dtype weights

        def projection(
            transposed: torch.Tensor, bias: torch.Tensor | None, names: tuple[str, ...]
        ) -> Projection:
            weight = transposed.t()  # (out, in)
            if fmt == "packed":
                groups = int4(names, weight) if int4 is not None else None
                if groups is not None and int4_dot_is_available() and fits(groups):
                    return Int4DotLinear(groups, bias)
                if groups is not None and int4_kernel_is_fast():
                    return Int4Linear(groups, bias)
                return packed_rows(weight, bias)
            return DenseLinear(weight.to(dtype).contiguous(), bias)

        layers = []
        for index, layer in enumerate(weights.layers):
            qkv, o_proj, gate_up, down = projection_names(index, weights.fused_projections)
            layers.append(
                TorchLayer(
                    input_norm=layer.input_norm.to(compute_dtype),
                    qkv=projection(layer.qkv, layer.qkv_bias, qkv),
                    o_proj=projection(layer.o_proj, layer.o_bias, o_proj),
                    post_norm=layer.post_norm.to(compute_dtype),
                    gate_up=projection(layer.gate_up, None, gate_up),
                    down=projection(layer.down, None, down),
                    **{
                        name: getattr(layer, name).to(compute_dtype)
                        for name in ("qk_norm", "attn_out_norm", "mlp_out_norm")
                        if getattr(layer, name) is not None
                    },
                )
            )
        embed: DenseEmbedding | Int8Embedding
        lm_head: Projection
        if fmt == "packed":
            embed = Int8Embedding(weights.embed)
            lm_head = packed_rows(weights.lm_head.t())
        else:
            table = weights.embed.to(dtype)
            embed = DenseEmbedding(table)
            head = table if weights.tied else weights.lm_head.t().to(dtype).contiguous()
            lm_head = DenseLinear(head)
        final_norm = weights.final_norm.to(compute_dtype)
        head_is_embedding = fmt != "packed" and weights.tied
        return TorchWeights(fmt, embed, tuple(layers), final_norm, lm_head, head_is_embedding)

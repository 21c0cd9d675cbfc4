"""A packed projection as the compiled step's graph takes it, and how the graph multiplies by it.

Each format's tensors travel as graph inputs (a NamedTuple of them), so engines of one shape in
a process share the compiled code. Which branch runs is fixed per graph by the parts' type.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.engine_worker.torch_backend import graph_ops
from services.engine_worker.torch_backend.int4_dot import Int4DotLinear, prefill_rows_dense
from services.engine_worker.torch_backend.int8_dot import Int8DotLinear
from services.engine_worker.torch_backend.linear import Int4Linear, Int8Linear


class Int4Parts(NamedTuple):
    """An `Int4Linear` as the graph takes it; `dense` where prefill rows run as a bfloat16 GEMM
    (graph_ops.int4_rows)."""

    packed: torch.Tensor
    scale_zero: torch.Tensor
    dense: tuple[torch.Tensor, torch.Tensor] | None
    bias: torch.Tensor | None


class Int4DotParts(NamedTuple):
    """An `Int4DotLinear` as the graph takes it; `dense`: whether prefill rows run as a
    bfloat16 GEMM over the weight unpacked for the step (graph_ops.int4_dot_rows)."""

    nibbles: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    dense: bool
    bias: torch.Tensor | None


class Int8Parts(NamedTuple):
    """An `Int8Linear` as the graph takes it (graph_ops.int8_rows)."""

    handle: torch.Tensor
    out_features: int
    bias: torch.Tensor | None


class Int8DotParts(NamedTuple):
    """An `Int8DotLinear` as the graph takes it: every row through `kvmesh::int8_dot`."""

    weights: torch.Tensor
    row_scales: torch.Tensor
    bias: torch.Tensor | None


ProjectionParts = Int4Parts | Int4DotParts | Int8Parts | Int8DotParts
PACKED_PROJECTIONS = (Int4Linear, Int4DotLinear, Int8Linear, Int8DotLinear)


def project(
    x: torch.Tensor, parts: ProjectionParts, decodes: int, prefilling: bool
) -> torch.Tensor:
    """x: the step's rows, its `decodes` decode rows first; `prefilling`: whether any follow.
    Prefill rows go dense only where the format says so; a prompt token is always one row
    (step_inputs.flatten), and a decode row gets the same bits in either graph."""
    if isinstance(parts, Int8Parts):
        handle, out_features = parts.handle, parts.out_features
        out = Int8Linear.product(
            x, lambda rows: torch.ops.kvmesh.int8_rows(rows, handle, out_features)
        )
    elif isinstance(parts, Int8DotParts):
        out = Int8DotLinear.product(x, parts.weights, parts.row_scales)
    elif isinstance(parts, Int4DotParts):
        weights = (parts.nibbles, parts.scales, parts.mins)
        if not (parts.dense and prefilling):
            out = Int4DotLinear.product(x, *weights)
        else:
            dense = Int4DotLinear.dense_weight(*weights)
            out = torch.ops.kvmesh.int4_dot_rows(x.float(), decodes, *weights, dense).to(x.dtype)
    elif parts.dense is None or not prefilling:
        out = Int4Linear.product(x, parts.packed, parts.scale_zero)
    else:
        rows = x.to(Int4Linear.ACTIVATIONS)
        dense = Int4Linear.dense_weight(parts.packed, *parts.dense)
        out = torch.ops.kvmesh.int4_rows(rows, decodes, parts.packed, parts.scale_zero, dense)
        out = out.to(x.dtype)
    return out if parts.bias is None else out + parts.bias


def projection_parts(projection: object) -> ProjectionParts:
    if isinstance(projection, Int8Linear):
        handle = graph_ops.int8_handle(projection)
        return Int8Parts(handle, projection.out_features, projection.bias)
    if isinstance(projection, Int8DotLinear):
        return Int8DotParts(projection.weights, projection.row_scales, projection.bias)
    if isinstance(projection, Int4DotLinear):
        p = projection
        return Int4DotParts(p.nibbles, p.scales, p.mins, prefill_rows_dense(), p.bias)
    if not isinstance(projection, Int4Linear):
        raise TypeError(f"the compiled step runs packed projections, not {type(projection)}")
    return Int4Parts(
        projection._packed, projection._scale_zero, projection.dense_parts, projection.bias
    )

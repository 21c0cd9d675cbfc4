"""The compiled step's opaque ops: what the graph (compiled_model.py) must not trace.

`kvmesh::cache_and_prefill`, one a layer in the graph of steps with prefill rows (the
decode-only graph writes after it: graph_attention.py). The KV write: traced, every form of it
(`index_copy_`, `index_put_`, `scatter_`) made the graph guard the token count against 1, i.e.
a graph per size. Prefill attention: SDPA per chunk, eager, as the eager path runs it
(`prefill_attention`), so a prefill over cached blocks keeps a cold prefill's bits. A plain
library op: through `torch.library.custom_op`'s wrappers the write alone took 47 µs a call
(profiled), this op with the write and an empty prefill 29 µs.

`kvmesh::int8_rows`, one a projection where projections are int8 rows (AVX2 CPUs): fbgemm's
GEMM on the rows `Int8Linear.product` makes, which the graph traces and fuses (eager, they
cost more than the GEMM itself at batch 1). fbgemm's packed weight is a TorchScript object
that dynamo cannot take as an input, so the graph passes a handle tensor instead, which names
the projection here.

`kvmesh::int4_rows`, one a 4-bit projection in the graph of steps with prefill rows, where the
CPU has bfloat16 GEMMs: the decode rows through the 4-bit kernel, as in the decode-only graph,
and the prefill rows as bfloat16 GEMMs of fixed-size pieces over `Int4Linear.dense_weight`,
which the graph unpacks beside the op, one fused loop a projection (eager, its ops took 10x as
long). As the one op in place of the kernel, the loops around it are the decode-only graph's,
and a decode row's bits the same in both. `kvmesh::int4_dot_rows` is the same for
`Int4DotLinear` (int4_dot.py), whose decode rows run `kvmesh::int4_dot`.
"""

from __future__ import annotations

import weakref

import torch

from services.engine_worker.artifacts.int4_groups import GROUP
from services.engine_worker.torch_backend.linear import LINEAR_DYNAMIC, Int8Linear
from services.engine_worker.torch_backend.prefill_attention import (
    PrefillSegment,
    prefill_attention,
    prefill_mask,
)

_OPS = torch.library.Library("kvmesh", "DEF")
_OPS.define(
    "cache_and_prefill(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
    "Tensor key_write, Tensor value_write, Tensor q, Tensor segments, Tensor blocks, "
    "float scale, bool by_block) -> Tensor"
)


def _cache_and_prefill(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_write: torch.Tensor,
    value_write: torch.Tensor,
    q: torch.Tensor,
    segments: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
    by_block: bool,
) -> torch.Tensor:
    """k, v: (T, kv_heads, D) into their slots (attention.kv_write_indices); then q: (P, H, D),
    the step's prefill rows, attend. segments: (S, 3) first row, rows and context length of
    each prefill chunk; blocks: (S, max blocks) each chunk's block table, padded."""
    k_cache.view(-1).index_copy_(0, key_write, k.reshape(-1))
    v_cache.view(-1, v.shape[-1]).index_copy_(0, value_write, v.reshape(-1, v.shape[-1]))
    out = torch.empty_like(q)
    for (row, rows, context), table in zip(segments.tolist(), blocks, strict=True):
        # by_block (always, where the step compiles) masks each piece itself.
        mask = None if by_block else prefill_mask(context - rows, context)
        segment = PrefillSegment(row, rows, context, table[: -(-context // k_cache.shape[3])], mask)
        out[row : row + rows] = prefill_attention(
            q[row : row + rows], k_cache, v_cache, segment, scale, by_block
        )
    return out


_OPS.impl("cache_and_prefill", _cache_and_prefill, "CPU")


@torch.library.register_fake("kvmesh::cache_and_prefill")
def _(k_cache, v_cache, k, v, key_write, value_write, q, *rest):
    return torch.empty_like(q)


_OPS.define("int8_rows(Tensor rows, Tensor handle, int out_features) -> Tensor")
# handle -> its projection, for as long as the projection lives.
_INT8_PROJECTIONS: dict[int, weakref.ref[Int8Linear]] = {}


def int8_handle(projection: Int8Linear) -> torch.Tensor:
    """The tensor that names `projection` to `kvmesh::int8_rows`."""
    key = id(projection)
    _INT8_PROJECTIONS[key] = weakref.ref(projection)
    weakref.finalize(projection, _INT8_PROJECTIONS.pop, key, None)
    return torch.tensor(key)


def int8_projection(handle: torch.Tensor) -> Int8Linear:
    """The live projection `handle` names (KeyError once it is gone)."""
    projection = _INT8_PROJECTIONS[int(handle)]()
    if projection is None:  # collected, its finalizer not yet run
        raise KeyError(int(handle))
    return projection


def _int8_rows(rows: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return LINEAR_DYNAMIC(rows, int8_projection(handle)._packed, True)


_OPS.impl("int8_rows", _int8_rows, "CPU")


@torch.library.register_fake("kvmesh::int8_rows")
def _(rows, handle, out_features):
    return rows.new_empty((rows.shape[0], out_features))


_OPS.define(
    "int4_rows(Tensor rows, SymInt decodes, Tensor packed, Tensor scale_zero, Tensor dense) "
    "-> Tensor"
)


# Prefill rows are multiplied PREFILL_PIECE at a time, the last piece zero-padded: oneDNN picks
# its kernel by the row count (with AMX, 53-162 rows of the 3072x576 projection were summed in
# another order than 1,024), so only a fixed count gives a row the same bits whatever its
# batch. 256: the fastest piece measured with AMX (512 rows: 0.89 ms, one unpadded call 0.74).
PREFILL_PIECE = 256


def _int4_rows(
    rows: torch.Tensor,
    decodes: int,
    packed: torch.Tensor,
    scale_zero: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """rows (T, in) bfloat16, its `decodes` decode rows first -> (T, out) bfloat16; weight:
    the projection's (in, out) `Int4Linear.dense_weight`, for the prefill rows."""
    out = rows.new_empty((rows.shape[0], packed.shape[0]))
    if decodes:
        decoded = torch._weight_int4pack_mm_for_cpu(rows[:decodes], packed, GROUP, scale_zero)
        out[:decodes] = decoded
    if rows.shape[0] > decodes:
        out[decodes:] = _dense_pieces(rows[decodes:], weight)
    return out


def _dense_pieces(prefill: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """prefill (P, in) bfloat16 times weight (in, out) bfloat16, PREFILL_PIECE rows a GEMM."""
    padded = -(-prefill.shape[0] // PREFILL_PIECE) * PREFILL_PIECE
    pieces = prefill.new_zeros((padded, prefill.shape[1]))
    pieces[: prefill.shape[0]] = prefill
    dense = prefill.new_empty((padded, weight.shape[1]))
    for start in range(0, padded, PREFILL_PIECE):
        piece = slice(start, start + PREFILL_PIECE)
        torch.mm(pieces[piece], weight, out=dense[piece])
    return dense[: prefill.shape[0]]


_OPS.impl("int4_rows", _int4_rows, "CPU")


@torch.library.register_fake("kvmesh::int4_rows")
def _(rows, decodes, packed, *rest):
    return rows.new_empty((rows.shape[0], packed.shape[0]))


_OPS.define(
    "int4_dot_rows(Tensor rows, SymInt decodes, Tensor nibbles, Tensor scales, Tensor mins, "
    "Tensor dense) -> Tensor"
)


def _int4_dot_rows(
    rows: torch.Tensor,
    decodes: int,
    nibbles: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """`int4_rows` for `Int4DotLinear`: rows (T, in) float32, decode rows through
    `kvmesh::int4_dot`, prefill rows as bfloat16 GEMMs over its `dense_weight` -> (T, out)."""
    out = rows.new_empty((rows.shape[0], weight.shape[1]))
    if decodes:
        out[:decodes] = torch.ops.kvmesh.int4_dot(rows[:decodes], nibbles, scales, mins)
    if rows.shape[0] > decodes:
        out[decodes:] = _dense_pieces(rows[decodes:].to(torch.bfloat16), weight)
    return out


_OPS.impl("int4_dot_rows", _int4_dot_rows, "CPU")


@torch.library.register_fake("kvmesh::int4_dot_rows")
def _(rows, decodes, nibbles, scales, mins, weight):
    return rows.new_empty((rows.shape[0], weight.shape[1]))

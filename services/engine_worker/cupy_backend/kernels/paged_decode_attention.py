"""Launcher of paged_decode_attention.cu (flash-decoding: splits decided per sequence on the
device, merged by the last split to finish)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import NULL, DTypeSpec, kernel

THREADS = 128
MAX_GROUP = 8  # query heads per KV head (kMaxGroup in the kernel)
HEAD_DIMS = (32, 64, 128, 256)  # 256 (Gemma 3) in 16-bit types: a lane's chunk is 8 values
BLOCK_SIZES = (8, 16, 32)  # KV block sizes the kernel is compiled for
# A split takes at least this many positions: a 1k context at batch 1 runs as 4 CTAs per KV
# head, and a merge is paid only where the context is longer than one split.
MIN_PARTITION = 256
# The grid offers enough splits for this many CTAs per SM when every context is long.
CTAS_PER_SM = 2


@dataclass(frozen=True)
class DecodeScratch:
    """Per-split partials (float32) and the merge tickets (int32, zero between launches) for
    `rows` sequences of `heads` query heads and up to `splits` splits each."""

    out: Any  # (rows, heads, splits, D)
    stats: Any  # (rows, heads, splits, 2): max and sum of exp(score - max)
    tickets: Any  # (rows, kv_heads)

    @property
    def splits(self) -> int:
        return int(self.out.shape[2])

    @staticmethod
    def allocate(rows: int, heads: int, kv_heads: int, splits: int, head_dim: int) -> DecodeScratch:
        import cupy

        return DecodeScratch(
            cupy.empty((rows, heads, splits, head_dim), numpy.float32),
            cupy.empty((rows, heads, splits, 2), numpy.float32),
            cupy.zeros((rows, kv_heads), numpy.int32),
        )


@dataclass(frozen=True)
class FusedWrite:
    """A decode-only step's rotary and KV write, done by the attention kernel itself: the
    QKV bias (or None), positions (int32), the RoPE tables and each row's slot (int64)."""

    bias: Any | None
    positions: Any
    cos: Any
    sin: Any
    slots: Any


def grid_splits(rows: int, kv_heads: int, sm_count: int) -> int:
    """Splits the grid offers each sequence: fewer as rows fill the GPU on their own. Fixed
    for a batch size, so a captured graph's grid stays valid whatever the contexts."""
    return max(1, -(-CTAS_PER_SM * sm_count // max(1, rows * kv_heads)))


def scratch_rows_by_splits(max_rows: int, kv_heads: int, sm_count: int) -> int:
    """The most (row, split) pairs any batch of up to `max_rows` rows uses."""
    return max(rows * grid_splits(rows, kv_heads, sm_count) for rows in range(1, max_rows + 1))


def instantiation(spec: DTypeSpec, head_dim: int, block_size: int) -> tuple[str, tuple[str, ...]]:
    """The kernel's name for these sizes, and the defines that make NVRTC compile only it
    (and its other storage types)."""
    name = f"paged_decode_attention_{spec.suffix}_d{head_dim}_b{block_size}"
    return name, (f"KVMESH_HEAD_DIM={head_dim}", f"KVMESH_BLOCK_SIZE={block_size}")


def check_shape(
    num_heads: int, kv_heads: int, head_dim: int, block_size: int, itemsize: int = 2
) -> None:
    """`itemsize`: the KV's bytes an element (head_dim 256 needs 16-bit K and V)."""
    if (
        num_heads % kv_heads
        or num_heads // kv_heads > MAX_GROUP
        or head_dim not in HEAD_DIMS
        or head_dim * itemsize > 32 * 16  # a position's row over at most 32 lanes' 16 bytes
        or block_size not in BLOCK_SIZES
    ):
        raise ValueError(
            f"decode attention supports head_dim {HEAD_DIMS} (256 in float16 or bfloat16), KV "
            f"blocks of {BLOCK_SIZES} tokens and up to {MAX_GROUP} query heads per KV head; got "
            f"head_dim {head_dim} ({itemsize}-byte elements), blocks of {block_size}, "
            f"{num_heads} heads, {kv_heads} KV heads"
        )


def paged_decode_attention(
    out: Any,
    qkv: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    context_lens: Any,
    num_heads: int,
    scale: float,
    scratch: DecodeScratch,
    spec: DTypeSpec,
    fused: FusedWrite | None = None,
    min_partition: int = MIN_PARTITION,
    window: int = 0,
) -> None:
    """out (S, H * D) for the first S rows of qkv (one query each). Caches are
    (blocks, kv_heads, block, D); block_tables int32 (S, max_blocks); context_lens int32 (S,),
    each >= 1 and counting the new token. scratch: views for S rows; its split count is the
    grid's. With `fused`, the rows' Q and K are still unrotated and the new K/V not written.
    `window` > 0: a sliding layer's, each row reads its last `window` positions only."""
    num_seqs, max_blocks = block_tables.shape
    _, kv_heads, block_size, head_dim = key_cache.shape
    check_shape(num_heads, kv_heads, head_dim, block_size, spec.itemsize)
    if not num_seqs:
        return
    rope = fused or FusedWrite(None, NULL, NULL, NULL, NULL)
    kernel("paged_decode_attention", *instantiation(spec, head_dim, block_size))(
        (scratch.splits, num_seqs, kv_heads),
        (THREADS,),
        (
            out,
            scratch.out,
            scratch.stats,
            scratch.tickets,
            qkv,
            numpy.int32(qkv.shape[1]),
            NULL if rope.bias is None else rope.bias,
            rope.cos,
            rope.sin,
            rope.positions,
            rope.slots,
            key_cache,
            value_cache,
            block_tables,
            numpy.int32(max_blocks),
            context_lens,
            numpy.int32(num_heads),
            numpy.int32(kv_heads),
            numpy.int32(min_partition),
            numpy.float32(scale),
            numpy.int32(window),
        ),
    )

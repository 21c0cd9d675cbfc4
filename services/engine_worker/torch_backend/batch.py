"""Turns the scheduled requests of one step into the tensors the torch model runs on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from services.engine_worker.step_inputs import RequestState, flatten
from services.engine_worker.torch_backend.attention import (
    AttentionMetadata,
    DecodeIndex,
    PrefillSegment,
    kv_write_indices,
    prefill_mask,
)


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (S,) rows whose logits are sampled
    sampling_states: tuple[RequestState, ...]  # (S,) in sample_rows order


def build_batch(
    scheduled: list[tuple[RequestState, int]],
    block_size: int,
    kv_heads: int,
    num_heads: int,
    head_dim: int,
    tables: numpy.ndarray | None = None,
) -> StepBatch:
    """Decodes (one new token) first, then prefill chunks, each request's tokens contiguous;
    `tables`: the worker's block tables (persistent_batch.py)."""
    flat = flatten(scheduled, block_size, tables)
    # Decode attention reads (block, request, valid slots) pairs: every block of each context.
    pair_block: list[int] = []
    pair_request: list[int] = []
    pair_limit: list[int] = []
    for row, (table_row, context) in enumerate(
        zip(flat.decode_table.tolist(), flat.decode_context_lens, strict=True)
    ):
        blocks = table_row[: -(-context // block_size)]
        pair_block += blocks
        pair_request += [row] * len(blocks)
        pair_limit += [block_size] * (len(blocks) - 1) + [context - (len(blocks) - 1) * block_size]
    segments = []
    for index, (start, context) in enumerate(
        zip(flat.prefill_starts, flat.prefill_context_lens, strict=True)
    ):
        mask = prefill_mask(start, context)
        token_start = flat.prefill_query_starts[index]
        block_table = torch.tensor(flat.prefill_blocks[index])
        segments.append(PrefillSegment(token_start, context - start, context, block_table, mask))
    positions = torch.tensor(flat.positions, dtype=torch.long)
    key_write, value_write = kv_write_indices(
        torch.tensor(flat.token_blocks, dtype=torch.long), positions, kv_heads, head_dim, block_size
    )
    decode = None
    if flat.decode_context_lens:
        decode = DecodeIndex.build(
            pair_block,
            pair_request,
            pair_limit,
            len(flat.decode_context_lens),
            kv_heads,
            num_heads // kv_heads,
            head_dim,
            block_size,
        )
    meta = AttentionMetadata(key_write, value_write, decode, tuple(segments))
    return StepBatch(
        torch.tensor(flat.input_ids, dtype=torch.long),
        positions,
        meta,
        torch.tensor(flat.sample_rows, dtype=torch.long),
        tuple(flat.sampling_states),
    )

"""Turns the scheduled requests of one step into the tensors the torch model runs on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from services.engine_worker.step_inputs import FlatBatch, RequestState, flatten
from services.engine_worker.torch_backend.attention import (
    AttentionMetadata,
    DecodeIndex,
    kv_write_indices,
)
from services.engine_worker.torch_backend.prefill_attention import PrefillSegment, prefill_mask


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (S + Q,) rows whose logits are sampled, then scoring rows
    sampling_states: tuple[RequestState, ...]  # (S,) in sample_rows order
    flat: FlatBatch  # the rows it was built from


def build_batch(
    scheduled: list[tuple[RequestState, int]],
    block_size: int,
    kv_heads: int,
    num_heads: int,
    head_dim: int,
    tables: numpy.ndarray | None = None,
    window: int | None = None,
    window_blocks: bool = False,
) -> StepBatch:
    """Decodes (one new token) first, then prefill chunks, each request's tokens contiguous;
    `tables`: the worker's block tables (persistent_batch.py); `window`: the model's sliding
    layers' (their own metadata beside the full layers'); `window_blocks`: those layers keep
    their window only, in blocks of their own (the requests' window_ids)."""
    flat = flatten(scheduled, block_size, tables, window if window_blocks and window else 0)
    positions = torch.tensor(flat.positions, dtype=torch.long)

    def metadata(window: int | None, own_blocks: bool = False) -> AttentionMetadata:
        token_blocks = flat.window_token_blocks if own_blocks else flat.token_blocks
        key_write, value_write = kv_write_indices(
            torch.tensor(token_blocks, dtype=torch.long), positions, kv_heads, head_dim, block_size
        )
        prefill_blocks = flat.window_prefill_blocks if own_blocks else flat.prefill_blocks
        decode_table = flat.window_decode_table if own_blocks else flat.decode_table
        segments = []
        for index, (start, context) in enumerate(
            zip(flat.prefill_starts, flat.prefill_context_lens, strict=True)
        ):
            mask = prefill_mask(start, context, window)
            token_start = flat.prefill_query_starts[index]
            block_table = torch.tensor(prefill_blocks[index])
            segments.append(
                PrefillSegment(token_start, context - start, context, block_table, mask, window)
            )
        decode = None
        if flat.decode_context_lens:
            pairs = _decode_pairs(decode_table, flat.decode_context_lens, block_size, window)
            decode = DecodeIndex.build(
                **pairs, kv_heads=kv_heads, group=num_heads // kv_heads, head_dim=head_dim
            )
        return AttentionMetadata(key_write, value_write, decode, tuple(segments))

    meta = metadata(None)
    if window is not None:
        meta = dataclasses.replace(meta, windowed=metadata(window, window_blocks))
    return StepBatch(
        torch.tensor(flat.input_ids, dtype=torch.long),
        positions,
        meta,
        torch.tensor(flat.logit_rows, dtype=torch.long),
        tuple(flat.sampling_states),
        flat,
    )


def _decode_pairs(
    table: numpy.ndarray, context_lens: list[int], block_size: int, window: int | None
) -> dict[str, Any]:
    """Decode attention reads (block, request, valid slots) pairs: every block of each context,
    or of its last `window` positions."""
    pair_block: list[int] = []
    pair_request: list[int] = []
    pair_limit: list[int] = []
    pair_first: list[int] = []
    for row, (table_row, context) in enumerate(zip(table.tolist(), context_lens, strict=True)):
        start = 0 if window is None else max(0, context - window)
        first_block, end_block = start // block_size, -(-context // block_size)
        blocks = table_row[first_block:end_block]
        pair_block += blocks
        pair_request += [row] * len(blocks)
        pair_limit += [block_size] * (len(blocks) - 1) + [context - (end_block - 1) * block_size]
        pair_first += [start - first_block * block_size] + [0] * (len(blocks) - 1)
    return dict(
        pair_block=pair_block,
        pair_request=pair_request,
        pair_limit=pair_limit,
        num_requests=len(context_lens),
        block_size=block_size,
        pair_first=None if window is None else pair_first,
    )

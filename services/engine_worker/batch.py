"""Turns the scheduled requests of one step into the tensors the model runs on."""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import torch

from services.engine_worker.attention import (
    AttentionMetadata,
    DecodeIndex,
    PrefillSegment,
    kv_write_indices,
)
from shared.sampling import SamplingParams


@dataclass
class RequestState:
    """What the worker remembers of a request between steps."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    prompt_len: int
    matcher: llguidance.LLMatcher | None = None  # a response format's state, if it has one


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
) -> StepBatch:
    """Decodes (one new token) first, then prefill chunks, each request's tokens contiguous."""
    decodes = [(s, n) for s, n in scheduled if n == 1]
    prefills = [(s, n) for s, n in scheduled if n > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    token_blocks: list[int] = []
    pair_block: list[int] = []
    pair_request: list[int] = []
    pair_limit: list[int] = []
    segments: list[PrefillSegment] = []
    sample_rows: list[int] = []
    sampling_states: list[RequestState] = []
    for row, (state, _) in enumerate(decodes):
        position = state.num_computed_tokens
        input_ids.append(state.token_ids[position])
        positions.append(position)
        token_blocks.append(state.block_ids[position // block_size])
        num_blocks = position // block_size + 1
        pair_block += state.block_ids[:num_blocks]
        pair_request += [row] * num_blocks
        pair_limit += [block_size] * (num_blocks - 1) + [
            position - (num_blocks - 1) * block_size + 1
        ]
        if position + 1 == len(state.token_ids):
            sample_rows.append(row)
            sampling_states.append(state)
    for state, num_new in prefills:
        start = state.num_computed_tokens
        context = start + num_new
        token_start = len(input_ids)
        input_ids += state.token_ids[start:context]
        positions += range(start, context)
        token_blocks += [state.block_ids[p // block_size] for p in range(start, context)]
        mask = None
        if start:  # a cached prefix: queries see all of it plus the causal part of the chunk
            mask = torch.arange(context)[None, :] <= torch.arange(start, context)[:, None]
        num_blocks = -(-context // block_size)
        segments.append(
            PrefillSegment(
                token_start, num_new, context, torch.tensor(state.block_ids[:num_blocks]), mask
            )
        )
        if context == len(state.token_ids):
            sample_rows.append(len(input_ids) - 1)
            sampling_states.append(state)
    positions_t = torch.tensor(positions, dtype=torch.long)
    key_write, value_write = kv_write_indices(
        torch.tensor(token_blocks, dtype=torch.long), positions_t, kv_heads, head_dim, block_size
    )
    decode = None
    if decodes:
        decode = DecodeIndex.build(
            pair_block,
            pair_request,
            pair_limit,
            len(decodes),
            kv_heads,
            num_heads // kv_heads,
            head_dim,
            block_size,
        )
    meta = AttentionMetadata(key_write, value_write, decode, tuple(segments))
    return StepBatch(
        torch.tensor(input_ids, dtype=torch.long),
        positions_t,
        meta,
        torch.tensor(sample_rows, dtype=torch.long),
        tuple(sampling_states),
    )

"""Paged attention in torch over a ragged batch, reading K/V through block tables.

Decodes (one query each) run together, flash-decoding style, with no gathered copy of the cache:
both products are `embedding_bag` weighted sums straight out of the pool. For Q·K, K is stored
transposed per block, (blocks, kv_heads, D, block), so each "row" is one dimension across a
block's positions and a block's scores are the q-weighted sum of its D rows. For P·V, each
request's output is the p-weighted sum of its V rows. Partial softmaxes per (request, block) are
merged per request with segment reductions. The torch call count per layer is fixed whatever
the batch, and no request is padded. Prefill chunks (many queries each, few per step) gather
their blocks once and run SDPA (prefill_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine_worker.torch_backend.prefill_attention import (
    PrefillSegment,
    prefill_attention,
    softcapped_prefill,
)


@dataclass(frozen=True)
class DecodeIndex:
    """Row indices into the pool for the decode rows, built once per step for every layer.

    Pairs are (decode request, one of its blocks), ordered by request.
    """

    num_requests: int
    pair_request: torch.Tensor  # (P,)
    pair_request_heads: torch.Tensor  # (P, kv_heads, G), for scatter_reduce
    pair_bias: torch.Tensor  # (P, 1, 1, block) 0, or -inf past the context end
    key_rows: torch.Tensor  # (P * kv_heads * G * D,) one bag of D rows per (pair, head, group)
    key_offsets: torch.Tensor  # (P * kv_heads * G,)
    value_rows: torch.Tensor  # (kv_heads * G * P * block,) one bag per (head, group, request)
    value_offsets: torch.Tensor  # (kv_heads * G * num_requests,)

    @staticmethod
    def build(
        pair_block: list[int],
        pair_request: list[int],
        pair_limit: list[int],
        num_requests: int,
        kv_heads: int,
        group: int,
        head_dim: int,
        block_size: int,
        pair_first: list[int] | None = None,
    ) -> DecodeIndex:
        """`pair_limit`: a pair's valid slots end there; `pair_first`: they start there (a
        sliding window's first block), else at 0."""
        blocks = torch.tensor(pair_block, dtype=torch.long)
        requests = torch.tensor(pair_request, dtype=torch.long)
        pairs = blocks.shape[0]
        heads = torch.arange(kv_heads)
        slots = torch.arange(block_size)[None, :]
        valid = slots < torch.tensor(pair_limit)[:, None]
        if pair_first is not None:
            valid &= slots >= torch.tensor(pair_first)[:, None]
        bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
        # K table rows are (block, head, dim); V table rows are (block, head, position).
        key_rows = (
            blocks.view(-1, 1, 1, 1) * kv_heads + heads.view(1, -1, 1, 1)
        ) * head_dim + torch.arange(head_dim).view(1, 1, 1, -1)
        value_rows = (
            blocks.view(1, 1, -1, 1) * kv_heads + heads.view(-1, 1, 1, 1)
        ) * block_size + torch.arange(block_size).view(1, 1, 1, -1)
        pairs_before = torch.cumsum(torch.bincount(requests, minlength=num_requests), 0)
        request_start = (
            torch.cat([torch.zeros(1, dtype=torch.long), pairs_before[:-1]]) * block_size
        )
        head_group_start = torch.arange(kv_heads * group) * pairs * block_size
        # int32 row ids: the K bags read more index bytes than K itself, so halving them counts.
        # (Rows number blocks x kv_heads x max(D, block): far below 2**31 for any CPU pool.)
        return DecodeIndex(
            num_requests=num_requests,
            pair_request=requests,
            pair_request_heads=requests.view(-1, 1, 1).expand(-1, kv_heads, group),
            pair_bias=bias.view(-1, 1, 1, block_size),
            key_rows=key_rows.expand(-1, -1, group, -1).flatten().to(torch.int32),
            key_offsets=torch.arange(
                0, pairs * kv_heads * group * head_dim, head_dim, dtype=torch.int32
            ),
            value_rows=value_rows.expand(-1, group, -1, -1).flatten().to(torch.int32),
            value_offsets=(head_group_start[:, None] + request_start[None, :])
            .flatten()
            .to(torch.int32),
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step, shared by every layer. Decode rows come first in the batch."""

    key_write: torch.Tensor  # (T * kv_heads * D,) element of the K pool for each new value
    value_write: torch.Tensor  # (T * kv_heads,) row of the V pool for each new (token, head)
    decode: DecodeIndex | None
    prefills: tuple[PrefillSegment, ...]
    # The same step as sliding-window layers read it: decode pairs of the window's blocks only,
    # prefill masks cut at the window. None where no layer slides.
    windowed: AttentionMetadata | None = None


def kv_write_indices(
    token_blocks: torch.Tensor,
    positions: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each new token's K and V go: token_blocks and positions are (T,).

    Returns K pool elements (T * kv_heads * D,), (block, head, dim, position), and V pool rows
    (T * kv_heads,), (block, head, position)."""
    block_heads = token_blocks.view(-1, 1) * kv_heads + torch.arange(kv_heads)  # (T, kv_heads)
    offsets = (positions % block_size).view(-1, 1)
    dims = torch.arange(head_dim).view(1, 1, -1)
    key_write = (block_heads.unsqueeze(-1) * head_dim + dims) * block_size + offsets.unsqueeze(-1)
    return key_write.flatten(), (block_heads * block_size + offsets).flatten()


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """k, v: (T, kv_heads, D) into their slots of the pool."""
    k_cache.view(-1).index_copy_(0, meta.key_write, k.reshape(-1))
    v_cache.view(-1, v.shape[-1]).index_copy_(0, meta.value_write, v.reshape(-1, v.shape[-1]))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    exact_over_cache: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: (T, H, D); k_cache: (blocks, kv_heads, D, block); v_cache: (blocks, kv_heads, block, D).
    `exact_over_cache`: prefill queries by KV block (`prefill_attention`); `softcap`: scores become
    softcap * tanh(scores / softcap) before the mask (Gemma 2). Returns (T, H * D)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if meta.decode is not None:
        rows = meta.decode.num_requests
        out[:rows] = _decode(q[:rows], k_cache, v_cache, meta.decode, scale, softcap)
    for seg in meta.prefills:
        rows_of_seg = slice(seg.token_start, seg.token_start + seg.num_tokens)
        if softcap is not None:
            out[rows_of_seg] = softcapped_prefill(
                q[rows_of_seg], k_cache, v_cache, seg, scale, softcap
            )
        else:
            out[rows_of_seg] = prefill_attention(
                q[rows_of_seg], k_cache, v_cache, seg, scale, exact_over_cache
            )
    return out.view(num_tokens, num_heads * head_dim)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: DecodeIndex,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    kv_heads, block = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // kv_heads
    pairs = index.pair_request.shape[0]
    weights = (q * scale).view(batch, kv_heads, group, head_dim).index_select(0, index.pair_request)
    scores = F.embedding_bag(
        index.key_rows,
        k_cache.view(-1, block),
        index.key_offsets,
        mode="sum",
        per_sample_weights=weights.reshape(-1),
    )
    scores = scores.view(pairs, kv_heads, group, block)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = scores.add_(index.pair_bias)
    row_max = torch.full((batch, kv_heads, group), float("-inf"), dtype=q.dtype, device=q.device)
    row_max.scatter_reduce_(0, index.pair_request_heads, scores.amax(dim=-1), reduce="amax")
    probs = torch.exp_(scores.sub_(row_max.index_select(0, index.pair_request).unsqueeze(-1)))
    denom = torch.zeros((batch, kv_heads, group), dtype=q.dtype, device=q.device)
    denom.index_add_(0, index.pair_request, probs.sum(dim=-1))
    weighted = F.embedding_bag(
        index.value_rows,
        v_cache.view(-1, head_dim),
        index.value_offsets,
        mode="sum",
        per_sample_weights=probs.permute(1, 2, 0, 3).reshape(-1),
    )
    out = weighted.view(kv_heads, group, batch, head_dim).permute(2, 0, 1, 3) / denom.unsqueeze(-1)
    return out.reshape(batch, num_heads, head_dim)

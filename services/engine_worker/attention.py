"""Paged attention in torch over a ragged batch, reading K/V through block tables.

Decodes (one query each) are computed together, flash-decoding style: every (request, block)
pair is one unit, scored with a batched matmul, and the per-block partial softmaxes are merged
per request with segment reductions. The number of torch calls per layer is fixed whatever the
batch, and no request is padded to the longest one. Prefill chunks (many queries each, few per
step) run one SDPA call per request over their gathered blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSegment:
    token_start: int  # first row of this request in the batch
    num_tokens: int
    context_len: int  # cached + new tokens it attends to
    block_ids: torch.Tensor  # (num_blocks_covering_context,)
    mask: torch.Tensor | None  # (num_tokens, context_len) bool; None = plain causal square


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step, shared by every layer. Decode rows come first in the batch."""

    num_decodes: int
    write_index: torch.Tensor  # (T * kv_heads,) flat slot of each new K/V row
    pair_block: torch.Tensor  # (P,) block id of each decode (request, block) pair
    pair_request: torch.Tensor  # (P,) decode row it belongs to
    pair_request_heads: torch.Tensor  # (P, kv_heads, G) the same, expanded for scatter_reduce
    pair_bias: torch.Tensor  # (P, 1, 1, block_size) 0, or -inf past the context end
    prefills: tuple[PrefillSegment, ...]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """k, v: (T, kv_heads, D) into their slots of the pool."""
    head_dim = k.shape[-1]
    k_cache.view(-1, head_dim).index_copy_(0, meta.write_index, k.reshape(-1, head_dim))
    v_cache.view(-1, head_dim).index_copy_(0, meta.write_index, v.reshape(-1, head_dim))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: (T, H, D) -> (T, H * D)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], k_cache, v_cache, meta, scale)
    for seg in meta.prefills:
        rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
        out[rows] = _prefill(q[rows], k_cache, v_cache, seg, scale)
    return out.view(num_tokens, num_heads * head_dim)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    q_pairs = q.view(batch, kv_heads, group, head_dim).index_select(0, meta.pair_request)
    k_pairs = k_cache.index_select(0, meta.pair_block)  # (P, kv_heads, block, D)
    scores = torch.matmul(q_pairs, k_pairs.transpose(-1, -2))  # (P, kv_heads, G, block)
    scores = scores.mul_(scale).add_(meta.pair_bias)
    pair_max = scores.amax(dim=-1)  # (P, kv_heads, G)
    row_max = torch.full((batch, kv_heads, group), float("-inf"), dtype=q.dtype)
    row_max.scatter_reduce_(0, meta.pair_request_heads, pair_max, reduce="amax")
    probs = torch.exp_(scores.sub_(row_max.index_select(0, meta.pair_request).unsqueeze(-1)))
    denom = torch.zeros((batch, kv_heads, group), dtype=q.dtype)
    denom.index_add_(0, meta.pair_request, probs.sum(dim=-1))
    v_pairs = v_cache.index_select(0, meta.pair_block)
    numer = torch.zeros((batch, kv_heads, group, head_dim), dtype=q.dtype)
    numer.index_add_(0, meta.pair_request, torch.matmul(probs, v_pairs))
    return (numer / denom.unsqueeze(-1)).view(batch, num_heads, head_dim)


def _prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment, scale: float
) -> torch.Tensor:
    kv_heads, _block, head_dim = k_cache.shape[1:]
    k = k_cache.index_select(0, seg.block_ids).transpose(0, 1).reshape(kv_heads, -1, head_dim)
    v = v_cache.index_select(0, seg.block_ids).transpose(0, 1).reshape(kv_heads, -1, head_dim)
    k, v = k[:, : seg.context_len], v[:, : seg.context_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=seg.mask,
        is_causal=seg.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)  # (n, H, D)

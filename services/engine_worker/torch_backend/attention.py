"""Paged attention in torch over a ragged batch, reading K/V through block tables.

Decodes (one query each) run together, flash-decoding style, with no gathered copy of the cache:
both products are `embedding_bag` weighted sums straight out of the pool. For Q·K, K is stored
transposed per block, (blocks, kv_heads, D, block), so each "row" is one dimension across a
block's positions and a block's scores are the q-weighted sum of its D rows. For P·V, each
request's output is the p-weighted sum of its V rows. Partial softmaxes per (request, block) are
merged per request with segment reductions. The torch call count per layer is fixed whatever
the batch, and no request is padded. Prefill chunks (many queries each, few per step) gather
their blocks once and run SDPA over 16-query pieces that match KV blocks (see `_prefill`).
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
    # (num_tokens, context_len) bool: causal, past the cached prefix; None where pieces mask
    # themselves (`_prefill`'s by_block)
    mask: torch.Tensor | None


def prefill_mask(start: int, context: int) -> torch.Tensor:
    """Queries at [start, context) see the cached prefix and the causal part of their chunk."""
    return torch.arange(context)[None, :] <= torch.arange(start, context)[:, None]


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
    ) -> DecodeIndex:
        blocks = torch.tensor(pair_block, dtype=torch.long)
        requests = torch.tensor(pair_request, dtype=torch.long)
        pairs = blocks.shape[0]
        heads = torch.arange(kv_heads)
        valid = torch.arange(block_size)[None, :] < torch.tensor(pair_limit)[:, None]
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
) -> torch.Tensor:
    """q: (T, H, D); k_cache: (blocks, kv_heads, D, block); v_cache: (blocks, kv_heads, block, D).
    `exact_over_cache`: prefill queries by KV block (see `_prefill`). Returns (T, H * D)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if meta.decode is not None:
        rows = meta.decode.num_requests
        out[:rows] = _decode(q[:rows], k_cache, v_cache, meta.decode, scale)
    for seg in meta.prefills:
        rows_of_seg = slice(seg.token_start, seg.token_start + seg.num_tokens)
        out[rows_of_seg] = _prefill(q[rows_of_seg], k_cache, v_cache, seg, scale, exact_over_cache)
    return out.view(num_tokens, num_heads * head_dim)


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: DecodeIndex, scale: float
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
    scores = scores.view(pairs, kv_heads, group, block).add_(index.pair_bias)
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


# A query piece's keys, rounded up to a multiple of this: the pieces of a chunk whose rounded
# lengths agree share one SDPA call. The rounding depends on the piece alone, so a query meets
# the same call shape however its prompt was cut; the keys past its own are masked (exact zeros
# in its sums). 64: per layer as fast as one call per piece cut at the chunk's end was, from 180
# to 1,536 tokens (0.55 against 0.61 ms at 180).
PIECE_KEYS = 64


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
    by_block: bool,
) -> torch.Tensor:
    """`by_block`: queries in 16-row pieces, one a KV block, each over the keys up to its
    block's end rounded up to `PIECE_KEYS`; a query takes its position's row of its block's
    piece, zero queries the rows its chunk lacks. A query's attention is then computed from the
    same operands by the same call shape whether its prompt prefix was cached or not (the cache
    holds whole blocks) and wherever the step budget cut the prompt into chunks, so a prefill
    over cached blocks gives the bits a cold one gives (tested). One SDPA over all queries does
    not: it rounds a row differently with the number of rows beside it (measured at most
    lengths under 300), which rounded activations (packed weights) turned into a different
    sampled token now and then for the same seed; nor did pieces cut at a chunk's end. float32
    does not need it: its GEMMs round a row by its batch anyway, at a level that does not
    change its tokens."""
    kv_heads, head_dim, block = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, seg.block_ids).permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
    v = v_cache.index_select(0, seg.block_ids).transpose(0, 1).reshape(kv_heads, -1, head_dim)
    first = seg.context_len - seg.num_tokens  # position of the first query
    if not by_block:
        k, v = k.to(q.dtype), v.to(q.dtype)  # the compiled step's pool may be float16
        cold = first == 0  # a plain causal square: SDPA skips the masked half itself
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, H, n, D)
            k[:, : seg.context_len].unsqueeze(0),
            v[:, : seg.context_len].unsqueeze(0),
            attn_mask=None if cold else seg.mask,
            is_causal=cold,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)  # (n, H, D)
    return _by_pieces(q, k, v, first, seg.context_len, block, scale)


def _by_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first: int,
    context: int,
    block: int,
    scale: float,
) -> torch.Tensor:
    """q (n, H, D) at positions [first, context); k, v (kv_heads, >= context, D) from 0."""
    heads, head_dim = q.shape[1], q.shape[2]
    first_piece, end_piece = first // block, -(-context // block)
    padded = -(-end_piece * block // PIECE_KEYS) * PIECE_KEYS
    # Zeros past the context (the pool there is unwritten, maybe not finite).
    keys = q.new_zeros((k.shape[0], padded, head_dim))
    values = q.new_zeros((k.shape[0], padded, head_dim))
    keys[:, :context], values[:, :context] = k[:, :context], v[:, :context]
    offset = first_piece * block  # position of the first piece's row 0
    queries = q.new_zeros(((end_piece - first_piece) * block, heads, head_dim))
    queries[first - offset : context - offset] = q
    queries = queries.view(-1, block, heads, head_dim).transpose(1, 2)  # (pieces, H, 16, D)
    out = torch.empty_like(queries)
    piece = first_piece
    while piece < end_piece:
        length = -(-(piece + 1) * block // PIECE_KEYS) * PIECE_KEYS
        last = min(end_piece, length // block)  # pieces [piece, last) share `length`
        count, rows = last - piece, slice(piece - first_piece, last - first_piece)
        positions = torch.arange(piece * block, last * block).view(count, 1, block, 1)
        mask = torch.zeros((count, 1, block, length), dtype=q.dtype)
        mask.masked_fill_(torch.arange(length) > positions, float("-inf"))
        out[rows] = F.scaled_dot_product_attention(
            queries[rows],
            keys[:, :length].expand(count, -1, -1, -1),
            values[:, :length].expand(count, -1, -1, -1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        piece = last
    return out.transpose(1, 2).reshape(-1, heads, head_dim)[first - offset : context - offset]

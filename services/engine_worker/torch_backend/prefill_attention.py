"""Prefill attention over a ragged batch's chunks: each gathers its blocks once and runs SDPA,
over 16-query pieces that match KV blocks where the bits must not depend on the cache
(`prefill_attention`'s by_block)."""

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
    # themselves (`prefill_attention`'s by_block)
    mask: torch.Tensor | None
    window: int | None = None  # a sliding layer's: the mask (or the pieces) cut at it


def prefill_mask(start: int, context: int, window: int | None = None) -> torch.Tensor:
    """Queries at [start, context) see the cached prefix and the causal part of their chunk;
    with a window, only the `window` keys up to their own position."""
    keys, queries = torch.arange(context)[None, :], torch.arange(start, context)[:, None]
    if window is None:
        return keys <= queries
    return (keys <= queries) & (keys > queries - window)


# A query piece's keys, rounded up to a multiple of this: the pieces of a chunk whose rounded
# lengths agree share one SDPA call. The rounding depends on the piece alone, so a query meets
# the same call shape however its prompt was cut; the keys past its own are masked (exact zeros
# in its sums). 64: per layer as fast as one call per piece cut at the chunk's end was, from 180
# to 1,536 tokens (0.55 against 0.61 ms at 180).
PIECE_KEYS = 64


def prefill_attention(
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
    block = k_cache.shape[3]
    k, v = _gathered(k_cache, v_cache, seg)
    first = seg.context_len - seg.num_tokens  # position of the first query
    if not by_block:
        k, v = k.to(q.dtype), v.to(q.dtype)  # the compiled step's pool may be float16
        # A plain causal square: SDPA skips the masked half itself.
        cold = first == 0 and (seg.window is None or seg.context_len <= seg.window)
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
    return _by_pieces(q, k, v, first, seg.context_len, block, scale, seg.window)


def _gathered(
    k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's blocks of K and V, each (kv_heads, blocks * block, D) in position order."""
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    k = k_cache.index_select(0, seg.block_ids).permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
    v = v_cache.index_select(0, seg.block_ids).transpose(0, 1).reshape(kv_heads, -1, head_dim)
    return k, v


def softcapped_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Scores capped before the mask, which SDPA cannot do: the products written out."""
    context, group = seg.context_len, q.shape[1] // k_cache.shape[1]
    k, v = _gathered(k_cache, v_cache, seg)
    k = k[:, :context].to(q.dtype).repeat_interleave(group, 0)  # (H, context, D)
    v = v[:, :context].to(q.dtype).repeat_interleave(group, 0)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # (H, n, context)
    scores = torch.tanh(scores / softcap) * softcap
    mask = prefill_mask(context - seg.num_tokens, context, seg.window)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v).transpose(0, 1)  # (n, H, D)


def _by_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first: int,
    context: int,
    block: int,
    scale: float,
    window: int | None = None,
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
        hidden = torch.arange(length) > positions
        if window is not None:
            hidden |= torch.arange(length) <= positions - window
        mask.masked_fill_(hidden, float("-inf"))
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

"""The compiled step's one opaque op a layer, `kvmesh::cache_and_prefill`: what the graph
(compiled_model.py) must not trace.

The KV write: traced, every form of it (`index_copy_`, `index_put_`, `scatter_`) made the graph
guard the token count against 1, i.e. a graph per size. Prefill attention: SDPA per chunk,
eager, as the eager path runs it (`attention._prefill`), so a prefill over cached blocks keeps
a cold prefill's bits. A plain library op: through `torch.library.custom_op`'s wrappers the
write alone took 47 µs a call (profiled), this op with the write and an empty prefill 29 µs.
"""

from __future__ import annotations

import torch

from services.engine_worker.attention import PrefillSegment, _prefill

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
        start = context - rows
        mask = torch.arange(context)[None, :] <= torch.arange(start, context)[:, None]
        segment = PrefillSegment(row, rows, context, table[: -(-context // k_cache.shape[3])], mask)
        out[row : row + rows] = _prefill(
            q[row : row + rows], k_cache, v_cache, segment, scale, by_block
        )
    return out


_OPS.impl("cache_and_prefill", _cache_and_prefill, "CPU")


@torch.library.register_fake("kvmesh::cache_and_prefill")
def _(k_cache, v_cache, k, v, key_write, value_write, q, *rest):
    return torch.empty_like(q)

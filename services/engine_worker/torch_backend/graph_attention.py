"""Decode attention as the compiled step computes it (compiled_model.py), and the KV write of a
decode-only step.

A decode row attends to the positions before it, read from the pool through its block table,
and to its own K and V, taken from the row itself as the pool holds them (float16 unless asked
otherwise: K and V convert where the kernels write and read them). So a decode-only step needs
nothing in the pool before its attention, and writes every layer's new K and V in one call
after the graph (`DecodeKvWriter`) instead of through an opaque op a layer, each of which cost
~56 µs crossing from a loaded program into Python.
Steps with prefill rows, and decode rows that read others of the same step (drafts, a
recompute), still write a layer's rows before its attention; their decode rows run this same
function, so a row's bits do not depend on which graph ran it.

Each (row, block) of K and V is read once: gather, both products, mask and softmax fuse into
loops over a block's positions. A row's sums run over its padded table in position order
(padding adds exact zeros: the longest row beside it changes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def decode_attention(
    q: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    outside: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: (B, H, D) decode rows; k_self, v_self: (B, kv_heads, D), each row's own, in the pool's
    dtype; table: (B, blocks); outside: (B, blocks, 1, 1, block) True at the positions a row
    does not read from the pool (its own and later). -> (B, H * D)."""
    decodes, heads, dim = q.shape
    kv_heads, block = k_cache.shape[1], k_cache.shape[3]
    group, num_blocks = heads // kv_heads, table.shape[1]
    q_rows = (q * scale).view(decodes, 1, kv_heads, group, dim, 1)
    # Scores (B, blocks, kv_heads, group, slot), reduced over D in place.
    k_rows = k_cache[table].to(q.dtype).view(decodes, num_blocks, kv_heads, 1, dim, block)
    scores = (q_rows * k_rows).sum(4).masked_fill(outside, float("-inf"))
    own = (q_rows.view(decodes, kv_heads, group, dim) * k_self.to(q.dtype).unsqueeze(2)).sum(-1)
    top = torch.maximum(scores.amax(dim=(1, 4)), own)  # (B, kv_heads, group)
    probs = torch.exp(scores - top.view(decodes, 1, kv_heads, group, 1))
    own_prob = torch.exp(own - top).unsqueeze(-1)
    v_rows = v_cache[table].to(q.dtype).view(decodes, num_blocks, kv_heads, 1, block, dim)
    weighted = (probs.unsqueeze(-1) * v_rows).sum(dim=(1, 4))  # (B, kv_heads, group, D)
    weighted = weighted + own_prob * v_self.to(q.dtype).unsqueeze(2)
    total = probs.sum(dim=(1, 4)).unsqueeze(-1) + own_prob
    return (weighted / total).reshape(decodes, heads * dim)


class DecodeKvWriter:
    """Writes a decode-only step's new K and V, (layers, B, kv_heads, D), into every layer's
    pool after the graph, at their slots (attention.kv_write_indices). The pools' flat views
    are made once, not a step: at batch 1 that halved the write (1.2 to 0.7 ms a step, 2-vCPU
    AVX-512 Xeon)."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        dim = values[0].shape[-1]
        self._pools = [(k.view(-1), v.view(-1, dim)) for k, v in zip(keys, values, strict=True)]

    def __call__(
        self,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        key_write: torch.Tensor,
        value_write: torch.Tensor,
    ) -> None:
        layers, dim = len(self._pools), new_values.shape[-1]
        layer_keys = new_keys.reshape(layers, -1).unbind(0)
        layer_values = new_values.reshape(layers, -1, dim).unbind(0)
        for (k_pool, v_pool), k, v in zip(self._pools, layer_keys, layer_values, strict=True):
            k_pool.index_copy_(0, key_write, k)
            v_pool.index_copy_(0, value_write, v)

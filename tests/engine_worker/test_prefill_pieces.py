"""Prefill attention by pieces (`prefill_attention`, by_block): a query's bits must not depend
on how its prompt was split into a cached prefix and chunks (cut anywhere by the step's token
budget), and the result is attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine import Engine
from services.engine_worker.torch_backend.prefill_attention import PrefillSegment, prefill_attention
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.sampling import SamplingParams

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
SCALE = DIM**-0.5


def pool_with(keys: torch.Tensor, values: torch.Tensor, written: int, table: torch.Tensor):
    """A paged pool holding positions [0, written) of keys/values (KV_HEADS, n, DIM) in the
    blocks `table` names; every other slot NaN, as unwritten memory may be."""
    blocks = int(table.max()) + 1
    k_cache = torch.full((blocks, KV_HEADS, DIM, BLOCK), float("nan"))
    v_cache = torch.full((blocks, KV_HEADS, BLOCK, DIM), float("nan"))
    for position in range(written):
        block, slot = table[position // BLOCK], position % BLOCK
        k_cache[block, :, :, slot] = keys[:, position]
        v_cache[block, :, slot] = values[:, position]
    return k_cache, v_cache


def attend(q, keys, values, table, start: int, end: int) -> torch.Tensor:
    """Queries [start, end) of a prompt whose positions before `end` are in the pool."""
    k_cache, v_cache = pool_with(keys, values, end, table)
    segment = PrefillSegment(0, end - start, end, table[: -(-end // BLOCK)], None)
    return prefill_attention(q[start:end], k_cache, v_cache, segment, SCALE, by_block=True)


@pytest.mark.parametrize("length", [5, 47, 130, 300, 700])  # past 512 keys SDPA splits them
def test_a_prefill_over_a_cached_prefix_or_in_chunks_gives_the_cold_bits(length: int) -> None:
    torch.manual_seed(length)
    q = torch.randn(length, HEADS, DIM)
    keys, values = torch.randn(2, KV_HEADS, length, DIM)
    table = torch.randperm(length // BLOCK + 8)[: -(-length // BLOCK)]
    cold = attend(q, keys, values, table, 0, length)
    assert torch.isfinite(cold).all()
    for cached in sorted({0, (length - 1) // BLOCK * BLOCK, length // 2 // BLOCK * BLOCK}):
        for chunk in (7, 16, 100, 512):  # what the step budget left, block-aligned or not
            pieces = [
                attend(q, keys, values, table, start, min(start + chunk, length))
                for start in range(cached, length, chunk)
            ]
            assert torch.equal(torch.cat(pieces), cold[cached:]), (cached, chunk)
    causal = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.repeat_interleave(HEADS // KV_HEADS, 0),
        values.repeat_interleave(HEADS // KV_HEADS, 0),
        is_causal=True,
        scale=SCALE,
    ).transpose(0, 1)
    torch.testing.assert_close(cold, causal, rtol=1e-5, atol=1e-5)


def test_a_prompt_cut_anywhere_by_the_step_budget_keeps_its_bits(default_model_path: str) -> None:
    """The packed default model: a 100-token prompt alone is cut at 37 and 74 by a 37-token step
    budget, behind a 10-token prompt at 27 and 63; its logprobs must not change (they did when
    a piece's shape followed its chunk's end)."""
    scheduler = SchedulerConfig(max_num_batched_tokens=37, max_num_seqs=4)
    cache = CacheConfig(kv_memory_bytes=64 << 20, enable_prefix_caching=False)
    engine = Engine(EngineConfig(scheduler=scheduler, cache=cache))
    assert engine.manifest["weights"] == "packed"
    long, short = ([(613 * i + n) % 20000 + 100 for i in range(n)] for n in (100, 10))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = engine.generate([long], params)[0]
    behind = engine.generate([short, long], params)[1]
    assert alone.token_ids == behind.token_ids
    assert [lp.top for lp in alone.logprobs] == [lp.top for lp in behind.logprobs]

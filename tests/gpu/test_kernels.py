"""Each CUDA kernel against a torch reference on the CPU, over several shapes, block sizes and
the three storage types (tolerances in reference.py)."""

from __future__ import annotations

import math

import cupy
import numpy
import pytest
import torch
import torch.nn.functional as F

from services.engine_worker.artifacts.rope import RopeSpec
from services.engine_worker.cupy_backend.cublas_gemm import CublasGemm
from services.engine_worker.cupy_backend.kernels.bias_add import bias_add
from services.engine_worker.cupy_backend.kernels.embedding import embedding
from services.engine_worker.cupy_backend.kernels.greedy_sample import greedy_sample
from services.engine_worker.cupy_backend.kernels.library import DTypeSpec
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
    DecodeScratch,
    num_splits,
    paged_decode_attention,
)
from services.engine_worker.cupy_backend.kernels.paged_prefill_attention import (
    paged_prefill_attention,
)
from services.engine_worker.cupy_backend.kernels.reshape_and_cache import reshape_and_cache
from services.engine_worker.cupy_backend.kernels.rms_norm import add_rms_norm
from services.engine_worker.cupy_backend.kernels.rotary import rotary
from services.engine_worker.cupy_backend.kernels.silu_and_mul import silu_and_mul
from tests.gpu.reference import SPECS, assert_close, get, put, put_int, rounded

# (num_heads, kv_heads, head_dim): SmolLM2-135M, a Llama-3-8B layer, MHA with small heads.
HEAD_SHAPES = [(9, 3, 64), (32, 8, 128), (4, 4, 32)]
by_name = pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)


@by_name
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_embedding(spec: DTypeSpec, hidden: int) -> None:
    table = torch.randn(1000, hidden)
    ids = torch.randint(0, 1000, (37,))
    out = cupy.empty((37, hidden), spec.storage)
    embedding(out, put(table, spec), put_int(ids), spec)
    assert torch.equal(get(out, spec), rounded(table, spec)[ids])


@by_name
@pytest.mark.parametrize("hidden", [64, 576, 2048])
def test_add_rms_norm_with_and_without_the_residual_add(spec: DTypeSpec, hidden: int) -> None:
    residual, delta, weight = torch.randn(9, hidden), torch.randn(9, hidden), torch.rand(hidden)
    eps = 1e-5
    added = rounded(rounded(residual, spec) + rounded(delta, spec), spec)

    def reference(rows: torch.Tensor) -> torch.Tensor:
        normed = rounded(rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps), spec)
        return normed * rounded(weight, spec)

    residual_d, out = put(residual, spec), cupy.empty((9, hidden), spec.storage)
    add_rms_norm(out, residual_d, put(weight, spec), eps, spec, delta=put(delta, spec))
    assert_close(get(residual_d, spec), added, spec)
    assert_close(get(out, spec), reference(added), spec)
    # No add: the norm of the residual as it is.
    add_rms_norm(out, residual_d, put(weight, spec), eps, spec)
    assert_close(get(out, spec), reference(added), spec)
    # Rows: only the sampled rows are added to and normalized.
    rows = [8, 2]
    fresh, few = put(residual, spec), cupy.empty((2, hidden), spec.storage)
    add_rms_norm(
        few, fresh, put(weight, spec), eps, spec, delta=put(delta, spec), rows=put_int(rows)
    )
    assert_close(get(few, spec), reference(added[rows]), spec)
    untouched = get(fresh, spec)
    assert torch.equal(untouched[0], rounded(residual, spec)[0])


@by_name
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rotary_rotates_q_and_k_only(
    spec: DTypeSpec, num_heads: int, kv_heads: int, head_dim: int, rope_type: str
) -> None:
    rope = RopeSpec(theta=500000.0, rope_type=rope_type, factor=8.0)
    tokens, width = 11, (num_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width)
    positions = torch.randint(0, 4096, (tokens,))
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * rope.inv_freq(head_dim)[None, :]
    qkv_d = put(qkv, spec)
    rotary(
        qkv_d,
        put_int(positions),
        cupy.asarray(freqs.cos().numpy()),
        cupy.asarray(freqs.sin().numpy()),
        num_heads + kv_heads,
        head_dim,
        spec,
    )
    cos, sin = rope.cos_sin(head_dim, 4096, torch.float32)
    x = rounded(qkv, spec)
    rotated_heads = x[:, : (num_heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    half = head_dim // 2
    turned = torch.cat((-rotated_heads[..., half:], rotated_heads[..., :half]), dim=-1)
    expected = rotated_heads * cos[positions, None] + turned * sin[positions, None]
    actual = get(qkv_d, spec)
    assert_close(actual[:, : expected.numel() // tokens], expected.reshape(tokens, -1), spec)
    assert torch.equal(
        actual[:, (num_heads + kv_heads) * head_dim :], x[:, (num_heads + kv_heads) * head_dim :]
    )


def paged_cache(num_blocks: int, kv_heads: int, block: int, head_dim: int, spec: DTypeSpec):
    keys = torch.randn(num_blocks, kv_heads, block, head_dim)
    values = torch.randn(num_blocks, kv_heads, block, head_dim)
    return keys, values, put(keys, spec), put(values, spec)


@by_name
@pytest.mark.parametrize("block", [16, 32])
def test_reshape_and_cache_writes_each_slot_and_skips_padding(spec: DTypeSpec, block: int) -> None:
    num_heads, kv_heads, head_dim, tokens = 9, 3, 64, 20
    keys, values, key_d, value_d = paged_cache(8, kv_heads, block, head_dim, spec)
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim)
    slots = torch.randperm(8 * block)[:tokens]
    slots[3] = -1  # a padded row
    reshape_and_cache(
        key_d,
        value_d,
        put(qkv, spec),
        put_int(slots, numpy.int64),
        num_heads * head_dim,
        kv_heads,
        head_dim,
        spec,
    )
    x = rounded(qkv, spec)
    expected_k, expected_v = rounded(keys, spec), rounded(values, spec)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        k = x[row, num_heads * head_dim : (num_heads + kv_heads) * head_dim].view(
            kv_heads, head_dim
        )
        v = x[row, (num_heads + kv_heads) * head_dim :].view(kv_heads, head_dim)
        expected_k[slot // block, :, slot % block] = k
        expected_v[slot // block, :, slot % block] = v
    assert torch.equal(get(key_d, spec), expected_k)
    assert torch.equal(get(value_d, spec), expected_v)


@by_name
def test_silu_and_mul_and_bias_add(spec: DTypeSpec) -> None:
    gate_up = torch.randn(13, 2 * 1536)
    out = cupy.empty((13, 1536), spec.storage)
    silu_and_mul(out, put(gate_up, spec), spec)
    x = rounded(gate_up, spec)
    assert_close(get(out, spec), rounded(F.silu(x[:, :1536]), spec) * x[:, 1536:], spec)
    rows, bias = torch.randn(5, 960), torch.randn(960)
    rows_d = put(rows, spec)
    bias_add(rows_d, put(bias, spec), spec)
    assert_close(get(rows_d, spec), rounded(rows, spec) + rounded(bias, spec), spec)


@by_name
@pytest.mark.parametrize(
    ("tokens", "inner", "columns"), [(1, 576, 960), (37, 576, 49152), (128, 1536, 576)]
)
def test_gemm_is_a_row_major_matmul(spec: DTypeSpec, tokens: int, inner: int, columns: int) -> None:
    x, weight = torch.randn(tokens, inner) / inner**0.5, torch.randn(inner, columns)
    gemm = CublasGemm(cupy.cuda.get_current_stream())
    out = cupy.empty((tokens, columns), spec.storage)
    gemm(put(x, spec), put(weight, spec), out, spec)
    expected = rounded(x, spec) @ rounded(weight, spec)
    assert_close(get(out, spec), expected, spec)
    logits = cupy.empty((tokens, columns), numpy.float32)
    gemm(put(x, spec), put(weight, spec), logits, spec, out_type=0)
    torch.testing.assert_close(
        torch.from_numpy(cupy.asnumpy(logits)), expected, atol=2e-3, rtol=2e-3
    )


def reference_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: list[int],
    context: int,
    query_positions: list[int],
    scale: float,
) -> torch.Tensor:
    """q (n, H, D) at the given positions over one sequence's paged context -> (n, H, D)."""
    num_heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, keys.shape[3])[:, :context]
    v = values[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, keys.shape[3])[:, :context]
    k = k.repeat_interleave(num_heads // kv_heads, 0)
    v = v.repeat_interleave(num_heads // kv_heads, 0)
    scores = torch.einsum("nhd,hcd->nhc", q, k) * scale
    visible = torch.arange(context)[None, :] <= torch.tensor(query_positions)[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nhc,hcd->nhd", scores.softmax(-1), v)


@by_name
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("block", [16, 32])
def test_paged_decode_attention(
    spec: DTypeSpec, num_heads: int, kv_heads: int, head_dim: int, block: int
) -> None:
    contexts = [1, 17, 512, 513, 3000]  # one block, a partial block, split edges, many splits
    blocks_needed = [math.ceil(c / block) for c in contexts]
    num_blocks = sum(blocks_needed) + 3
    keys, values, key_d, value_d = paged_cache(num_blocks, kv_heads, block, head_dim, spec)
    shuffled = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for count in blocks_needed:
        tables.append(shuffled[start : start + count])
        start += count
    width = max(blocks_needed)
    table = numpy.zeros((len(contexts), width), numpy.int32)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = blocks
    qkv = torch.randn(len(contexts), (num_heads + 2 * kv_heads) * head_dim)
    scale = head_dim**-0.5
    out = cupy.empty((len(contexts), num_heads * head_dim), spec.storage)
    scratch = DecodeScratch.allocate(len(contexts), num_heads, num_splits(max(contexts)), head_dim)
    paged_decode_attention(
        out,
        put(qkv, spec),
        key_d,
        value_d,
        cupy.asarray(table),
        put_int(contexts),
        num_heads,
        scale,
        scratch,
        spec,
    )
    q = rounded(qkv, spec)[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k_ref, v_ref = rounded(keys, spec), rounded(values, spec)
    actual = get(out, spec).view(-1, num_heads, head_dim)
    for row, context in enumerate(contexts):
        expected = reference_attention(
            q[row : row + 1], k_ref, v_ref, tables[row], context, [context - 1], scale
        )
        assert_close(actual[row : row + 1], expected, spec)


@by_name
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("block", [16, 32])
def test_paged_prefill_attention_over_cached_prefixes(
    spec: DTypeSpec, num_heads: int, kv_heads: int, head_dim: int, block: int
) -> None:
    # (cached prefix, new tokens): a fresh prompt, a chunk after a cached prefix, one token.
    segments = [(0, 37), (40, 25), (64, 1), (5, 70)]
    contexts = [cached + new for cached, new in segments]
    blocks_needed = [math.ceil(c / block) for c in contexts]
    num_blocks = sum(blocks_needed)
    keys, values, key_d, value_d = paged_cache(num_blocks, kv_heads, block, head_dim, spec)
    shuffled = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for count in blocks_needed:
        tables.append(shuffled[start : start + count])
        start += count
    table = numpy.zeros((len(segments), max(blocks_needed)), numpy.int32)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = blocks
    starts = numpy.cumsum([0] + [new for _, new in segments]).astype(numpy.int32)
    tokens = int(starts[-1])
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim)
    scale = head_dim**-0.5
    out = cupy.empty((tokens, num_heads * head_dim), spec.storage)
    paged_prefill_attention(
        out,
        put(qkv, spec),
        key_d,
        value_d,
        cupy.asarray(table),
        cupy.asarray(starts),
        put_int(contexts),
        max(n for _, n in segments),
        num_heads,
        scale,
        spec,
    )
    q = rounded(qkv, spec)[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    actual = get(out, spec).view(tokens, num_heads, head_dim)
    k_ref, v_ref = rounded(keys, spec), rounded(values, spec)
    for row, (cached, new) in enumerate(segments):
        rows = slice(int(starts[row]), int(starts[row + 1]))
        positions = list(range(cached, cached + new))
        expected = reference_attention(
            q[rows], k_ref, v_ref, tables[row], contexts[row], positions, scale
        )
        assert_close(actual[rows], expected, spec)


def test_greedy_sample_takes_the_lowest_id_among_ties_and_its_logprob() -> None:
    logits = torch.randn(6, 49152) * 3
    logits[2, 100] = logits[2, 40000] = 50.0  # a tie: the lower id wins, as torch.argmax
    tokens, logprobs = cupy.empty(6, numpy.int32), cupy.empty(6, numpy.float32)
    greedy_sample(cupy.asarray(logits.numpy()), tokens, logprobs)
    expected = logits.argmax(-1)
    assert cupy.asnumpy(tokens).tolist() == expected.tolist()
    assert cupy.asnumpy(tokens)[2] == 100
    reference = torch.log_softmax(logits, -1).gather(1, expected[:, None]).squeeze(1)
    torch.testing.assert_close(
        torch.from_numpy(cupy.asnumpy(logprobs)), reference, atol=1e-4, rtol=1e-4
    )

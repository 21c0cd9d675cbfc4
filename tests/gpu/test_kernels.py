"""Each CUDA kernel against a torch reference on the CPU, over several shapes, block sizes and
the three storage types (tolerances in reference.py)."""

from __future__ import annotations

import math
from typing import Any

import cupy
import numpy
import pytest
import torch
import torch.nn.functional as F

from services.engine_worker.artifacts.rope import RopeSpec
from services.engine_worker.cupy_backend.cublas_gemm import CublasGemm
from services.engine_worker.cupy_backend.kernels.bias_add import bias_add
from services.engine_worker.cupy_backend.kernels.library import DTypeSpec
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
    DecodeScratch,
    FusedWrite,
    paged_decode_attention,
)
from services.engine_worker.cupy_backend.kernels.paged_prefill_attention import (
    paged_prefill_attention,
)
from services.engine_worker.cupy_backend.kernels.rms_norm import (
    add_rms_norm,
    embed_rms_norm,
    head_rms_norm,
)
from services.engine_worker.cupy_backend.kernels.rotary_and_cache import rotary_and_cache
from services.engine_worker.cupy_backend.kernels.silu_and_mul import (
    gelu_tanh_and_mul,
    silu_and_mul,
)
from tests.gpu.reference import SPECS, assert_close, get, put, put_int, rounded

# (num_heads, kv_heads, head_dim): SmolLM2-135M, a Llama-3-8B layer, MHA with small heads.
HEAD_SHAPES = [(9, 3, 64), (32, 8, 128), (4, 4, 32)]
by_name = pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)


@by_name
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_embed_rms_norm_gathers_then_normalizes(spec: DTypeSpec, hidden: int) -> None:
    table, weight = torch.randn(1000, hidden), torch.rand(hidden)
    ids = torch.randint(0, 1000, (37,))
    residual, out = cupy.empty((37, hidden), spec.storage), cupy.empty((37, hidden), spec.storage)
    embed_rms_norm(out, residual, put(table, spec), put_int(ids), put(weight, spec), 1e-5, spec)
    rows = rounded(table, spec)[ids]
    assert torch.equal(get(residual, spec), rows)
    normed = rounded(rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-5), spec)
    assert_close(get(out, spec), normed * rounded(weight, spec), spec)
    # Gemma's scale (sqrt(hidden), as the compute dtype holds it), on the gathered rows.
    scale = float(rounded(torch.tensor(hidden**0.5), spec))
    table_d, ids_d, weight_d = put(table, spec), put_int(ids), put(weight, spec)
    embed_rms_norm(out, residual, table_d, ids_d, weight_d, 1e-5, spec, scale)
    assert torch.equal(get(residual, spec), rounded(rows * scale, spec))


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
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEAD_SHAPES)
def test_head_rms_norm_norms_each_q_and_k_head_in_place(
    spec: DTypeSpec, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Qwen3's q_norm / k_norm: each Q and K head over head_dim with its own weight row; V
    untouched."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv, weight = torch.randn(11, width), torch.rand(heads + kv_heads, head_dim) + 0.5
    qkv_d = put(qkv, spec)
    head_rms_norm(qkv_d, put(weight, spec), 1e-6, spec)
    x = rounded(qkv, spec)
    qk = x[:, : (heads + kv_heads) * head_dim].reshape(11, heads + kv_heads, head_dim)
    normed = rounded(qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6), spec)
    expected = torch.cat(
        (rounded(normed * rounded(weight, spec), spec).reshape(11, -1), x[:, qk[0].numel() :]), 1
    )
    assert_close(get(qkv_d, spec), expected, spec)


def rope_tables(rope: RopeSpec, head_dim: int, positions: int = 4096) -> tuple[Any, Any]:
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * rope.inv_freq(head_dim)[None]
    return cupy.asarray(freqs.cos().numpy()), cupy.asarray(freqs.sin().numpy())


def rotated_reference(
    qkv: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor, rope: RopeSpec,
    heads: int, kv_heads: int, head_dim: int, spec: DTypeSpec,
) -> torch.Tensor:  # fmt: skip
    """Each fused row as bias add, rotary and their stores in T leave it."""
    x = rounded(qkv, spec)
    if bias is not None:
        x = rounded(x + rounded(bias, spec), spec)
    tokens, turned = x.shape[0], (heads + kv_heads) * head_dim
    cos, sin = rope.cos_sin(head_dim, 4096, torch.float32)
    rotated = x[:, :turned].view(tokens, -1, head_dim)
    half = head_dim // 2
    other = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    out = x.clone()
    out[:, :turned] = (rotated * cos[positions, None] + other * sin[positions, None]).reshape(
        tokens, -1
    )
    return out


def paged_cache(num_blocks: int, kv_heads: int, block: int, head_dim: int, spec: DTypeSpec):
    keys = torch.randn(num_blocks, kv_heads, block, head_dim)
    values = torch.randn(num_blocks, kv_heads, block, head_dim)
    return keys, values, put(keys, spec), put(values, spec)


@by_name
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rotary_and_cache_rotates_q_and_k_and_writes_each_slot(
    spec: DTypeSpec, num_heads: int, kv_heads: int, head_dim: int, rope_type: str, with_bias: bool
) -> None:
    rope = RopeSpec(theta=500000.0, rope_type=rope_type, factor=8.0)
    block, tokens, width = 16, 11, (num_heads + 2 * kv_heads) * head_dim
    qkv, bias = torch.randn(tokens, width), torch.randn(width) if with_bias else None
    positions = torch.randint(0, 4096, (tokens,))
    keys, values, key_d, value_d = paged_cache(8, kv_heads, block, head_dim, spec)
    slots = torch.randperm(8 * block)[:tokens]
    slots[3] = -1  # a padded row
    qkv_d = put(qkv, spec)
    rotary_and_cache(
        qkv_d,
        None if bias is None else put(bias, spec),
        put_int(positions),
        *rope_tables(rope, head_dim),
        put_int(slots, numpy.int64),
        key_d,
        value_d,
        num_heads,
        spec,
    )
    expected = rotated_reference(qkv, bias, positions, rope, num_heads, kv_heads, head_dim, spec)
    actual = get(qkv_d, spec)
    assert_close(actual, expected, spec)
    expected_k, expected_v = rounded(keys, spec), rounded(values, spec)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_and_v = actual[row, num_heads * head_dim :].view(2, kv_heads, head_dim)
            expected_k[slot // block, :, slot % block] = k_and_v[0]
            expected_v[slot // block, :, slot % block] = k_and_v[1]
    assert torch.equal(get(key_d, spec), expected_k)  # what the row holds, bit for bit
    assert torch.equal(get(value_d, spec), expected_v)


@by_name
def test_silu_and_mul_and_bias_add(spec: DTypeSpec) -> None:
    gate_up = torch.randn(13, 2 * 1536)
    out = cupy.empty((13, 1536), spec.storage)
    silu_and_mul(out, put(gate_up, spec), spec)
    x = rounded(gate_up, spec)
    assert_close(get(out, spec), rounded(F.silu(x[:, :1536]), spec) * x[:, 1536:], spec)
    gelu_tanh_and_mul(out, put(gate_up, spec), spec)  # Gemma's GeGLU
    gelu = rounded(F.gelu(x[:, :1536], approximate="tanh"), spec)
    assert_close(get(out, spec), gelu * x[:, 1536:], spec)
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
    window: int = 0,
) -> torch.Tensor:
    """q (n, H, D) at the given positions over one sequence's paged context -> (n, H, D);
    `window` > 0: each query sees its last `window` positions only (a sliding layer)."""
    num_heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, keys.shape[3])[:, :context]
    v = values[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, keys.shape[3])[:, :context]
    k = k.repeat_interleave(num_heads // kv_heads, 0)
    v = v.repeat_interleave(num_heads // kv_heads, 0)
    scores = torch.einsum("nhd,hcd->nhc", q, k) * scale
    visible = torch.arange(context)[None, :] <= torch.tensor(query_positions)[:, None]
    if window > 0:
        visible &= torch.arange(context)[None, :] > torch.tensor(query_positions)[:, None] - window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nhc,hcd->nhd", scores.softmax(-1), v)


@by_name
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("grid_splits", [1, 5, 64])
@pytest.mark.parametrize("window", [0, 100])
def test_paged_decode_attention(
    spec: DTypeSpec,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    grid_splits: int,
    window: int,
) -> None:
    """One block, a partial block, split edges and many splits; launched twice, so a merge
    ticket left set would show in the second run. A window of 100 (a sliding layer's) starts
    mid-block."""
    contexts = [1, 17, 256, 257, 3000, 9000]
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
    scratch = DecodeScratch.allocate(len(contexts), num_heads, kv_heads, grid_splits, head_dim)
    q = rounded(qkv, spec)[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k_ref, v_ref = rounded(keys, spec), rounded(values, spec)
    for _ in range(2):
        paged_decode_attention(
            out, put(qkv, spec), key_d, value_d, cupy.asarray(table), put_int(contexts),
            num_heads, scale, scratch, spec, window=window,
        )  # fmt: skip
        actual = get(out, spec).view(-1, num_heads, head_dim)
        for row, context in enumerate(contexts):
            expected = reference_attention(
                q[row : row + 1], k_ref, v_ref, tables[row], context, [context - 1], scale, window
            )
            assert_close(actual[row : row + 1], expected, spec)
    assert not cupy.asnumpy(scratch.tickets).any()


@by_name
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), HEAD_SHAPES[:2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_decode_attention_rotates_writes_the_new_token_and_attends_to_it(
    spec: DTypeSpec, num_heads: int, kv_heads: int, head_dim: int, with_bias: bool
) -> None:
    """A decode-only step: Q and K unrotated in the rows, the new K/V not yet cached. Same
    output and cache as rotary_and_cache, then attention; a slot of -1 writes nothing."""
    block, contexts = 16, [1, 40, 700, 2100]
    width = math.ceil(max(contexts) / block)
    table = numpy.arange(len(contexts) * width, dtype=numpy.int32).reshape(len(contexts), width)
    slots = [
        int(table[r, (c - 1) // block]) * block + (c - 1) % block for r, c in enumerate(contexts)
    ]
    slots[0] = -1
    rope = RopeSpec(theta=10000.0)
    qkv = torch.randn(len(contexts), (num_heads + 2 * kv_heads) * head_dim)
    bias = torch.randn(qkv.shape[1]) if with_bias else None
    keys, values, _, _ = paged_cache(len(contexts) * width, kv_heads, block, head_dim, spec)
    positions = put_int([c - 1 for c in contexts])

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key_d, value_d, rows = put(keys, spec), put(values, spec), put(qkv, spec)
        bias_d = None if bias is None else put(bias, spec)
        cos, sin = rope_tables(rope, head_dim)
        out = cupy.empty((len(contexts), num_heads * head_dim), spec.storage)
        scratch = DecodeScratch.allocate(len(contexts), num_heads, kv_heads, 8, head_dim)
        common = (cupy.asarray(table), put_int(contexts), num_heads, head_dim**-0.5, scratch, spec)
        slots_d = put_int(slots, numpy.int64)
        if fused:
            write = FusedWrite(bias_d, positions, cos, sin, slots_d)
            paged_decode_attention(out, rows, key_d, value_d, *common, write)
        else:
            rotary_and_cache(
                rows, bias_d, positions, cos, sin, slots_d, key_d, value_d, num_heads, spec
            )
            paged_decode_attention(out, rows, key_d, value_d, *common)
        return get(out, spec), get(key_d, spec), get(value_d, spec)

    fused, unfused = run(True), run(False)
    assert_close(fused[0], unfused[0], spec)
    assert torch.equal(fused[1], unfused[1]) and torch.equal(fused[2], unfused[2])
    assert torch.equal(fused[1][0], rounded(keys, spec)[0])  # slot -1: block 0 untouched


@by_name
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), HEAD_SHAPES)
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("window", [0, 24])
def test_paged_prefill_attention_over_cached_prefixes(
    spec: DTypeSpec, num_heads: int, kv_heads: int, head_dim: int, block: int, window: int
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
        window,
    )
    q = rounded(qkv, spec)[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    actual = get(out, spec).view(tokens, num_heads, head_dim)
    k_ref, v_ref = rounded(keys, spec), rounded(values, spec)
    for row, (cached, new) in enumerate(segments):
        rows = slice(int(starts[row]), int(starts[row + 1]))
        positions = list(range(cached, cached + new))
        expected = reference_attention(
            q[rows], k_ref, v_ref, tables[row], contexts[row], positions, scale, window
        )
        assert_close(actual[rows], expected, spec)

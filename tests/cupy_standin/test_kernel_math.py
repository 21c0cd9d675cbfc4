"""The maths the new GPU kernels rest on, in numpy: decode attention's splits and its online
softmax merged across splits equal a plain softmax; the fused rotary + KV write inside decode
attention leaves the same output and cache as rotary_and_cache followed by attention."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy
import pytest

from tests.cupy_standin import installed
from tests.cupy_standin.kernels import decode_splits, merge_splits, online_softmax, rounded

BLOCK = 16


@pytest.mark.parametrize("context", [1, 15, 16, 17, 255, 256, 257, 1000, 4096, 33000])
@pytest.mark.parametrize("grid", [1, 2, 7, 88])
def test_splits_cover_the_context_in_whole_blocks_none_empty(context: int, grid: int) -> None:
    splits = decode_splits(context, grid, BLOCK, 256)
    assert splits[0][0] == 0 and splits[-1][1] == context
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(splits))
    assert all(first < end and first % BLOCK == 0 for first, end in splits)
    assert len(splits) <= min(grid, -(-context // 256))
    assert len(splits) == 1 or context > 256  # a short context is one split: no merge


@pytest.mark.parametrize("context", [1, 17, 300, 3000])
@pytest.mark.parametrize("grid", [1, 3, 64])
def test_online_softmax_over_splits_equals_a_plain_softmax(context: int, grid: int) -> None:
    rng = numpy.random.default_rng(context + grid)
    heads, dim = 3, 64
    q = rng.standard_normal((heads, dim), numpy.float32) * 0.5
    k = rng.standard_normal((context, heads, dim), numpy.float32) * 2.0  # peaked scores
    v = rng.standard_normal((context, heads, dim), numpy.float32)
    parts = [
        online_softmax(q, k[first:end], v[first:end], BLOCK)
        for first, end in decode_splits(context, grid, BLOCK, 256)
    ]
    merged = merge_splits(*(numpy.stack(column) for column in zip(*parts, strict=True)))
    scores = numpy.einsum("hd,thd->ht", q.astype(numpy.float64), k)
    weights = numpy.exp(scores - scores.max(axis=1, keepdims=True))
    expected = numpy.einsum("ht,thd->hd", weights / weights.sum(axis=1, keepdims=True), v)
    numpy.testing.assert_allclose(merged, expected, rtol=2e-5, atol=2e-5)


@pytest.fixture
def cupy() -> Iterator[Any]:
    with installed():
        import cupy

        yield cupy


@pytest.mark.parametrize("suffix", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_decode_attention_matches_rotary_and_cache_then_attention(
    cupy: Any, suffix: str, with_bias: bool
) -> None:
    from services.engine_worker.cupy_backend.kernels.library import DTYPES
    from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
        DecodeScratch,
        FusedWrite,
        paged_decode_attention,
    )
    from services.engine_worker.cupy_backend.kernels.rotary_and_cache import rotary_and_cache

    spec = DTYPES[suffix]
    s = "bf16" if suffix == "bfloat16" else "f32"
    rng = numpy.random.default_rng(1)
    heads, kv_heads, dim, seqs = 6, 2, 32, 3
    contexts = numpy.asarray([1, 40, 700], numpy.int32)  # one, two and three splits
    width = -(-int(contexts.max()) // BLOCK)
    tables = numpy.arange(seqs * width, dtype=numpy.int32).reshape(seqs, width)
    slots = numpy.asarray(
        [tables[r, (c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for r, c in enumerate(contexts)],
        numpy.int64,
    )
    slots[0] = -1  # a padded row of a graph: nothing written
    cache = rounded(rng.standard_normal((seqs * width, kv_heads, BLOCK, dim)), s)
    qkv = rounded(rng.standard_normal((seqs, (heads + 2 * kv_heads) * dim)), s)
    bias = rounded(rng.standard_normal(qkv.shape[1]), s) if with_bias else None
    angles = numpy.arange(1024)[:, None] * 0.01 * numpy.arange(1, dim // 2 + 1)[None, :]
    cos, sin = (cupy.asarray(f(angles).astype(numpy.float32)) for f in (numpy.cos, numpy.sin))
    positions = cupy.asarray(contexts - 1)

    def run(fused: bool) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        keys, values = cupy.asarray(cache.copy()), cupy.asarray(cache[::-1].copy())
        rows = cupy.asarray(qkv.copy())
        device_bias = None if bias is None else cupy.asarray(bias)
        out = cupy.empty((seqs, heads * dim), spec.storage)
        scratch = DecodeScratch.allocate(seqs, heads, kv_heads, 4, dim)
        args = (cupy.asarray(tables), cupy.asarray(contexts), heads, dim**-0.5, scratch, spec)
        if fused:
            write = FusedWrite(device_bias, positions, cos, sin, cupy.asarray(slots))
            paged_decode_attention(out, rows, keys, values, *args, write)
        else:
            rotary_and_cache(
                rows, device_bias, positions, cos, sin, cupy.asarray(slots), keys, values,
                heads, spec,
            )  # fmt: skip
            paged_decode_attention(out, rows, keys, values, *args)
        return out.get(), keys.get(), values.get()

    for fused, unfused in zip(run(True), run(False), strict=True):
        numpy.testing.assert_array_equal(fused, unfused)
    assert not numpy.array_equal(run(True)[1], cache)  # the new keys were written

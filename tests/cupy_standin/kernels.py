"""Each CUDA kernel of `services/engine_worker/cupy_backend/kernels/` written again in numpy.

A reference reads its launch the way the kernel does: flat buffers, the scalar arguments in
order, and the grid where the kernel reads gridDim or covers rows by blockIdx; a launcher
that passes a wrong grid or argument gets a wrong answer here as on a GPU. Math in float32,
each 16-bit store rounded to nearest even, as the kernels' from_float.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy

Grid = tuple[int, ...]


def to_float(values: numpy.ndarray, suffix: str) -> numpy.ndarray:
    if suffix == "bf16":
        return (values.astype(numpy.uint32) << 16).view(numpy.float32)
    return values.astype(numpy.float32)


def rounded(values: numpy.ndarray, suffix: str) -> numpy.ndarray:
    """float32 values as the storage type holds them."""
    values = numpy.asarray(values, numpy.float32)
    if suffix == "bf16":
        bits = values.view(numpy.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(numpy.uint16)
    if suffix == "f16":
        return values.astype(numpy.float16)
    return values


def _suffix(name: str) -> str:
    return next(s for s in ("f32", "f16", "bf16") if f"_{s}" in name)


def add_rms_norm(name: str, grid: Grid, args: tuple) -> None:
    out, residual, delta, weight, rows, hidden, eps = args
    s = _suffix(name)
    count = grid[0]
    sources = rows[:count] if rows is not None else numpy.arange(count)
    residual = residual.reshape(-1, hidden)
    if delta is not None:
        added = to_float(residual[sources], s) + to_float(delta.reshape(-1, hidden)[sources], s)
        residual[sources] = rounded(added, s)
    values = to_float(residual[sources], s)
    inv_rms = 1.0 / numpy.sqrt((values * values).mean(axis=1, keepdims=True) + eps)
    normed = to_float(rounded(values * inv_rms, s), s)
    out.reshape(-1, hidden)[:count] = rounded(normed * to_float(weight[:hidden], s), s)


def embed_rms_norm(name: str, grid: Grid, args: tuple) -> None:
    out, residual, table, ids, weight, hidden, eps, scale = args
    s, count = _suffix(name), grid[0]
    embedded = to_float(table.reshape(-1, hidden)[ids[:count]], s)
    residual.reshape(-1, hidden)[:count] = rounded(embedded * numpy.float32(scale), s)
    add_rms_norm(name, grid, (out, residual, None, weight, None, hidden, eps))


def head_rms_norm(name: str, grid: Grid, args: tuple) -> None:
    qkv, weight, heads, dim, width, eps = args
    s = _suffix(name)
    tokens = grid[0] // heads
    rows = qkv.reshape(-1, width)
    values = to_float(rows[:tokens, : heads * dim], s).reshape(tokens, heads, dim)
    inv_rms = 1.0 / numpy.sqrt((values * values).mean(axis=-1, keepdims=True) + eps)
    normed = to_float(rounded(values * inv_rms, s), s)
    scaled = rounded(normed * to_float(weight.reshape(heads, dim), s), s)
    rows[:tokens, : heads * dim] = scaled.reshape(tokens, heads * dim)


def _biased(values: numpy.ndarray, bias: numpy.ndarray | None, s: str) -> numpy.ndarray:
    """float32 (..., columns) plus the bias, rounded to the storage type as a bias add stores
    it; the values unchanged without a bias."""
    x = to_float(values, s)
    return x if bias is None else to_float(rounded(x + to_float(bias[: x.shape[-1]], s), s), s)


def _rotated(x: numpy.ndarray, cos: numpy.ndarray, sin: numpy.ndarray) -> numpy.ndarray:
    """x (T, heads, D) float32 turned by each row's angles (T, D / 2)."""
    half = x.shape[-1] // 2
    c, n = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return numpy.concatenate([x1 * c - x2 * n, x2 * c + x1 * n], axis=-1)


def _write_kv(
    caches: tuple[numpy.ndarray, numpy.ndarray],
    slots: numpy.ndarray,
    keys: numpy.ndarray,
    values: numpy.ndarray,
    block: int,
) -> None:
    """keys, values (T, kv_heads, D) in storage type to their slots (-1: nothing)."""
    keep = slots >= 0
    blocks, offsets = slots[keep] // block, slots[keep] % block
    kv_heads, dim = keys.shape[1:]
    for cache, new in zip(caches, (keys, values), strict=True):
        cache.reshape(-1, kv_heads, block, dim)[blocks, :, offsets] = new[keep]


def rotary_and_cache(name: str, grid: Grid, args: tuple) -> None:
    (qkv, bias, positions, cos, sin, slots, keys, values, stride, heads, kv_heads, dim, block) = (
        args
    )
    s, tokens, half = _suffix(name), grid[0], dim // 2
    rows = qkv.reshape(-1, stride)[:tokens]
    angles = positions[:tokens]
    turned_heads = heads + kv_heads
    width = turned_heads * dim
    x = _biased(rows[:, :width], bias, s).reshape(tokens, turned_heads, dim)
    c, n = cos.reshape(-1, half)[angles], sin.reshape(-1, half)[angles]
    rows[:, :width] = rounded(_rotated(x, c, n).reshape(tokens, -1), s)
    v_columns = slice(width, width + kv_heads * dim)
    v_bias = None if bias is None else bias[v_columns]
    rows[:, v_columns] = rounded(_biased(rows[:, v_columns], v_bias, s), s)
    k = rows[:, heads * dim : width].reshape(tokens, kv_heads, dim)
    v = rows[:, v_columns].reshape(tokens, kv_heads, dim)
    _write_kv((keys, values), slots[:tokens], k, v, block)


def _head_dim(name: str) -> int:
    return int(re.search(r"_d(\d+)(_b\d+)?$", name).group(1))  # type: ignore[union-attr]


def _keys_and_values(
    caches: tuple[numpy.ndarray, numpy.ndarray],
    table: numpy.ndarray,
    length: int,
    heads: int,
    kv_heads: int,
    block: int,
    dim: int,
    s: str,
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """(length, heads, D) float32 each: a sequence's keys and values read through its
    table, each KV head repeated for the query heads of its group."""
    positions = numpy.arange(length)
    blocks, offsets = table[positions // block], positions % block
    gathered = (
        to_float(cache.reshape(-1, kv_heads, block, dim)[blocks, :, offsets], s) for cache in caches
    )
    k, v = (numpy.repeat(part, heads // kv_heads, 1) for part in gathered)
    return k, v


def decode_splits(context: int, grid_splits: int, block: int, min_partition: int) -> list:
    """The kernel's split of one context: (first, end) positions of each split, none empty."""
    blocks = -(-context // block)
    per_split = -(-blocks // min(grid_splits, max(1, -(-context // min_partition))))
    return [
        (first * block, min((first + per_split) * block, context))
        for first in range(0, blocks, per_split)
    ]


def online_softmax(
    q: numpy.ndarray, k: numpy.ndarray, v: numpy.ndarray, chunk: int
) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """Attention of q (heads, D) over k, v (positions, heads, D) as the kernel computes it: a
    running max, sum and unnormalized output, updated `chunk` positions at a time. Returns
    (max, sum, out) per head."""
    heads, dim = q.shape
    top, total = numpy.full(heads, -numpy.inf, numpy.float32), numpy.zeros(heads, numpy.float32)
    out = numpy.zeros((heads, dim), numpy.float32)
    for start in range(0, k.shape[0], chunk):
        scores = numpy.einsum("hd,thd->ht", q, k[start : start + chunk])
        new_top = numpy.maximum(top, scores.max(axis=1))
        keep = numpy.where(top == -numpy.inf, 0.0, numpy.exp(top - new_top))
        weights = numpy.exp(scores - new_top[:, None])
        total = total * keep + weights.sum(axis=1)
        out = out * keep[:, None] + numpy.einsum("ht,thd->hd", weights, v[start : start + chunk])
        top = new_top
    return top, total, out


def merge_splits(tops: numpy.ndarray, totals: numpy.ndarray, outs: numpy.ndarray) -> numpy.ndarray:
    """Splits' (max, sum, unnormalized out), stacked on axis 0, as one normalized output."""
    weights = numpy.exp(tops - tops.max(axis=0))
    return (weights[..., None] * outs).sum(axis=0) / (weights * totals).sum(axis=0)[..., None]


def paged_decode_attention(name: str, grid: Grid, args: tuple) -> None:
    (
        out,
        p_out,
        p_stats,
        tickets,
        qkv,
        stride,
        bias,
        cos,
        sin,
        positions,
        slots,
        keys,
        values,
        tables,
        max_blocks,
        context_lens,
        heads,
        kv_heads,
        min_partition,
        scale,
        window,
    ) = args
    s, dim = _suffix(name), _head_dim(name)
    block = int(re.search(r"_b(\d+)$", name).group(1))  # type: ignore[union-attr]
    max_splits, seqs = grid[0], grid[1]
    rows = qkv.reshape(-1, stride)[:seqs]
    q = to_float(rows[:, : heads * dim], s).reshape(seqs, heads, dim)
    if cos is not None:  # fused: bias, rotary and the new K/V write happen here
        half = dim // 2
        turned = heads + kv_heads
        x = _biased(rows[:, : turned * dim], bias, s).reshape(seqs, turned, dim)
        angles = positions[:seqs]
        x = to_float(
            rounded(_rotated(x, cos.reshape(-1, half)[angles], sin.reshape(-1, half)[angles]), s), s
        )
        q = x[:, :heads]
        v_columns = slice(turned * dim, (turned + kv_heads) * dim)
        v_bias = None if bias is None else bias[v_columns]
        v_new = rounded(_biased(rows[:, v_columns], v_bias, s), s).reshape(seqs, kv_heads, dim)
        _write_kv((keys, values), slots[:seqs], rounded(x[:, heads:], s), v_new, block)
    tables = tables.reshape(-1, max_blocks)
    p_out = p_out.reshape(seqs, heads, max_splits, dim)
    p_stats = p_stats.reshape(seqs, heads, max_splits, 2)
    target = out.reshape(-1, heads * dim)
    for seq in range(seqs):
        length = int(context_lens[seq])
        k, v = _keys_and_values((keys, values), tables[seq], length, heads, kv_heads, block, dim, s)
        query = q[seq] * scale
        start = max(0, length - window) if window > 0 else 0  # a sliding layer's first key
        base = start // block * block  # its splits start at its window's first block
        spans = [
            (max(base + first, start), base + end)
            for first, end in decode_splits(length - base, max_splits, block, min_partition)
        ]
        parts = [online_softmax(query, k[lo:hi], v[lo:hi], 256) for lo, hi in spans]
        for split, (top, total, unnormalized) in enumerate(parts):
            p_out[seq, :, split], p_stats[seq, :, split] = (
                unnormalized,
                numpy.stack([top, total], -1),
            )
        merged = merge_splits(*(numpy.stack(column) for column in zip(*parts, strict=True)))
        target[seq] = rounded(merged.reshape(-1), s)
    if tickets[: seqs * kv_heads].any():  # each merger resets its own before the next launch
        raise ValueError("decode attention launched with a merge ticket left set")


def paged_prefill_attention(name: str, grid: Grid, args: tuple) -> None:
    (
        out,
        out_stride,
        qkv,
        stride,
        keys,
        values,
        tables,
        max_blocks,
        query_starts,
        context_lens,
        heads,
        kv_heads,
        block,
        scale,
        window,
    ) = args
    s, dim = _suffix(name), _head_dim(name)
    covered, seqs = grid[0] * 4, grid[1]  # four queries (warps) per block
    tables = tables.reshape(-1, max_blocks)
    for seq in range(seqs):
        first, chunk = int(query_starts[seq]), int(query_starts[seq + 1] - query_starts[seq])
        num_q = min(chunk, covered)  # a grid too small leaves the chunk's last rows unwritten
        length = int(context_lens[seq])
        rows = numpy.arange(first, first + num_q)
        q = to_float(qkv.reshape(-1, stride)[rows, : heads * dim], s).reshape(num_q, heads, dim)
        k, v = _keys_and_values((keys, values), tables[seq], length, heads, kv_heads, block, dim, s)
        scores = numpy.einsum("qhd,thd->hqt", q * scale, k)
        positions = length - chunk + numpy.arange(num_q)
        key_positions = numpy.arange(length)[None, :]
        hidden = key_positions > positions[:, None]
        if window > 0:  # a sliding layer's: keys more than a window back are hidden too
            hidden |= key_positions <= positions[:, None] - window
        scores[:, hidden] = -numpy.inf
        weights = numpy.exp(scores - scores.max(axis=2, keepdims=True))
        attended = numpy.einsum("hqt,thd->qhd", weights, v) / weights.sum(axis=2).T[..., None]
        target = out.reshape(-1, out_stride)
        target[rows, : heads * dim] = rounded(attended.reshape(num_q, heads * dim), s)


def _gated(activation: Callable[[numpy.ndarray], numpy.ndarray]) -> Callable:
    """A gated activation's reference: act(gate) rounded to the storage type, times up."""

    def run(name: str, grid: Grid, args: tuple) -> None:
        out, gate_up, inner = args
        s, tokens = _suffix(name), grid[0]
        rows = to_float(gate_up.reshape(-1, 2 * inner)[:tokens], s)
        gate, up = rows[:, :inner], rows[:, inner:]
        out.reshape(-1, inner)[:tokens] = rounded(to_float(rounded(activation(gate), s), s) * up, s)

    return run


silu_and_mul = _gated(lambda x: x / (1.0 + numpy.exp(-x)))
gelu_tanh_and_mul = _gated(  # 0.7978845608 = sqrt(2 / pi)
    lambda x: (
        numpy.float32(0.5)
        * x
        * (
            1.0
            + numpy.tanh(numpy.float32(0.7978845608028654) * (x + numpy.float32(0.044715) * x**3))
        )
    )
)


def bias_add(name: str, grid: Grid, args: tuple) -> None:
    out, bias, columns = args
    s, rows = _suffix(name), grid[0]
    target = out.reshape(-1, columns)[:rows]
    target[...] = rounded(to_float(target, s) + to_float(bias[:columns], s), s)


def _kept_threshold(w: numpy.ndarray, floor: float, top_k: int, top_p: float) -> float:
    """The weight a token needs to be drawn from, after min-p (floor), top-k and top-p."""
    kept = numpy.sort(w[w >= floor])[::-1]
    if not kept.shape[0]:
        return floor
    if 0 < top_k < w.shape[0] and kept.shape[0] > top_k:
        floor = max(floor, float(kept[top_k - 1]))  # the k-th largest, ties kept
        kept = kept[kept >= floor]
    if top_p < 1.0:
        budget = top_p * kept.sum(dtype=numpy.float32)
        values = numpy.unique(kept)  # ascending
        above = numpy.asarray([kept[kept > v].sum(dtype=numpy.float32) for v in values])
        floor = max(floor, float(values[numpy.argmax(above <= budget)]))
    return floor


def sample_tokens(name: str, grid: Grid, args: tuple) -> None:
    from services.engine_worker.sampler import counter_uniform

    (logits, vocab, temperatures, top_ks, top_ps, min_ps, keys, indices, top_ns, adjust_ends,
     adjustments, max_top, tokens, logprobs, top_ids, top_logprobs) = args  # fmt: skip
    top_ids, top_logprobs = top_ids.reshape(-1, max_top), top_logprobs.reshape(-1, max_top)
    adjustments = adjustments.reshape(-1, 4)
    for r, row in enumerate(logits.reshape(-1, vocab)[: grid[0]]):
        raw = row.copy()
        top = raw.max()
        log_total = numpy.log(numpy.exp(raw - top).sum(dtype=numpy.float32))
        ranked = numpy.lexsort((numpy.arange(vocab), -raw))[: min(int(top_ns[r]), max_top)]
        count = ranked.shape[0]  # larger values first, the lower id among equal ones
        top_ids[r, :count], top_logprobs[r, :count] = ranked, raw[ranked] - top - log_total
        first = int(adjust_ends[r - 1]) if r else 0
        entries = adjustments[first : max(first, int(adjust_ends[r]))]
        ids = entries.view(numpy.int32)[:, 0]
        x = row  # adjusted in place, as the kernel does
        x[ids] = numpy.where(x[ids] > 0, x[ids] / entries[:, 1], x[ids] * entries[:, 2])
        x[ids] += entries[:, 3]
        token = int(x.argmax())  # the lowest id among equal maxima
        x_top = x.max()
        if temperatures[r] > 0.0:
            w = numpy.exp((x - x_top) / numpy.float32(temperatures[r])).astype(numpy.float32)
            floor = _kept_threshold(w, float(min_ps[r]), int(top_ks[r]), float(top_ps[r]))
            kept = numpy.nonzero(w >= floor)[0]
            cumulative = numpy.cumsum(numpy.where(w >= floor, w, 0.0), dtype=numpy.float64)
            target = counter_uniform(int(keys[r]), int(indices[r])) * cumulative[-1]
            if kept.shape[0]:  # none: a row of NaNs keeps its argmax
                token = min(int(numpy.searchsorted(cumulative, target, side="right")), kept[-1])
        tokens[r] = token
        logprobs[r] = raw[token] - top - log_total


REFERENCES: dict[str, Callable[[str, Grid, tuple], None]] = {
    "add_rms_norm": add_rms_norm,
    "embed_rms_norm": embed_rms_norm,
    "head_rms_norm": head_rms_norm,
    "rotary_and_cache": rotary_and_cache,
    "paged_decode_attention": paged_decode_attention,
    "paged_prefill_attention": paged_prefill_attention,
    "silu_and_mul": silu_and_mul,
    "bias_add": bias_add,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "sample_tokens": sample_tokens,
}


def reference(function: str) -> Callable[[str, Grid, tuple], None]:
    """The reference of a kernel's instantiation, e.g. add_rms_norm_bf16."""
    base = re.sub(r"(_(f32|f16|bf16))?(_d\d+)?(_b\d+)?$", "", function)
    if base not in REFERENCES:
        raise AttributeError(f"no kernel named {function!r}")
    return REFERENCES[base]


def host_args(args: tuple[Any, ...]) -> tuple:
    """A launch's arguments as the reference takes them: arrays as flat views of their
    memory (None for a null pointer), numpy scalars as Python numbers."""
    from tests.cupy_standin.device import ndarray

    converted: list[Any] = []
    for arg in args:
        if isinstance(arg, ndarray):
            if not arg.flags.c_contiguous:
                raise ValueError("a kernel argument must be C-contiguous: it is read as flat")
            converted.append(arg._host.reshape(-1))
        elif isinstance(arg, numpy.uint64) and arg == 0:
            converted.append(None)
        elif isinstance(arg, (numpy.int32, numpy.int64)):
            converted.append(int(arg))
        elif isinstance(arg, numpy.float32):
            converted.append(float(arg))
        else:
            raise TypeError(
                f"kernel argument of type {type(arg).__name__}: pass a CuPy array or a numpy "
                "scalar of the kernel parameter's type"
            )
    return tuple(converted)

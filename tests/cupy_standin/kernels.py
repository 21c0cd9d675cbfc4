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


def embedding(name: str, grid: Grid, args: tuple) -> None:
    out, table, ids, hidden = args
    tokens = grid[0]
    out.reshape(-1, hidden)[:tokens] = table.reshape(-1, hidden)[ids[:tokens]]


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


def rotary(name: str, grid: Grid, args: tuple) -> None:
    qkv, positions, cos, sin, row_stride, heads, head_dim = args
    s, tokens, half = _suffix(name), grid[0], head_dim // 2
    rows = qkv.reshape(-1, row_stride)[:tokens]
    x = to_float(rows[:, : heads * head_dim], s).reshape(tokens, heads, head_dim)
    c = cos.reshape(-1, half)[positions[:tokens]][:, None, :]
    n = sin.reshape(-1, half)[positions[:tokens]][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    turned = numpy.concatenate([x1 * c - x2 * n, x2 * c + x1 * n], axis=-1)
    rows[:, : heads * head_dim] = rounded(turned.reshape(tokens, -1), s)


def reshape_and_cache(name: str, grid: Grid, args: tuple) -> None:
    key_cache, value_cache, qkv, slots, stride, key_at, value_at, kv_heads, dim, block = args
    rows = qkv.reshape(-1, stride)[: grid[0]]
    slots = slots[: grid[0]]
    keep = slots >= 0
    blocks, offsets = slots[keep] // block, slots[keep] % block
    width = kv_heads * dim
    for cache, start in ((key_cache, key_at), (value_cache, value_at)):
        heads = rows[keep, start : start + width].reshape(-1, kv_heads, dim)
        cache.reshape(-1, kv_heads, block, dim)[blocks, :, offsets] = heads


def _head_dim(name: str) -> int:
    return int(re.search(r"_d(\d+)$", name).group(1))  # type: ignore[union-attr]


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


def paged_decode_attention(name: str, grid: Grid, args: tuple) -> None:
    (
        p_out,
        p_max,
        p_sum,
        qkv,
        stride,
        keys,
        values,
        tables,
        max_blocks,
        context_lens,
        heads,
        kv_heads,
        block,
        partition,
        scale,
    ) = args
    s, dim = _suffix(name), _head_dim(name)
    splits, seqs = grid[0], grid[1]
    p_out = p_out.reshape(seqs, heads, splits, dim)
    p_max, p_sum = p_max.reshape(seqs, heads, splits), p_sum.reshape(seqs, heads, splits)
    tables = tables.reshape(-1, max_blocks)
    for seq in range(seqs):
        length = int(context_lens[seq])
        q = to_float(qkv.reshape(-1, stride)[seq, : heads * dim], s).reshape(heads, dim) * scale
        k, v = _keys_and_values((keys, values), tables[seq], length, heads, kv_heads, block, dim, s)
        scores = numpy.einsum("hd,thd->ht", q, k)
        for split in range(splits):
            start, end = split * partition, min((split + 1) * partition, length)
            if start >= length:
                p_out[seq, :, split], p_max[seq, :, split], p_sum[seq, :, split] = 0, -numpy.inf, 0
                continue
            part = scores[:, start:end]
            top = part.max(axis=1)
            weights = numpy.exp(part - top[:, None])
            p_max[seq, :, split], p_sum[seq, :, split] = top, weights.sum(axis=1)
            p_out[seq, :, split] = numpy.einsum("ht,thd->hd", weights, v[start:end])


def paged_decode_reduce(name: str, grid: Grid, args: tuple) -> None:
    out, p_out, p_max, p_sum, splits, dim = args
    s = _suffix(name)
    seqs, heads = grid
    p_out = p_out.reshape(seqs, heads, splits, dim)
    p_max, p_sum = p_max.reshape(seqs, heads, splits), p_sum.reshape(seqs, heads, splits)
    weights = numpy.exp(p_max - p_max.max(axis=2, keepdims=True))
    value = (weights[..., None] * p_out).sum(axis=2) / (weights * p_sum).sum(axis=2)[..., None]
    out.reshape(-1, heads * dim)[:seqs] = rounded(value.reshape(seqs, heads * dim), s)


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
        scores[:, numpy.arange(length)[None, :] > positions[:, None]] = -numpy.inf
        weights = numpy.exp(scores - scores.max(axis=2, keepdims=True))
        attended = numpy.einsum("hqt,thd->qhd", weights, v) / weights.sum(axis=2).T[..., None]
        target = out.reshape(-1, out_stride)
        target[rows, : heads * dim] = rounded(attended.reshape(num_q, heads * dim), s)


def silu_and_mul(name: str, grid: Grid, args: tuple) -> None:
    out, gate_up, inner = args
    s, tokens = _suffix(name), grid[0]
    rows = to_float(gate_up.reshape(-1, 2 * inner)[:tokens], s)
    gate, up = rows[:, :inner], rows[:, inner:]
    activated = to_float(rounded(gate / (1.0 + numpy.exp(-gate)), s), s)
    out.reshape(-1, inner)[:tokens] = rounded(activated * up, s)


def bias_add(name: str, grid: Grid, args: tuple) -> None:
    out, bias, columns = args
    s, rows = _suffix(name), grid[0]
    target = out.reshape(-1, columns)[:rows]
    target[...] = rounded(to_float(target, s) + to_float(bias[:columns], s), s)


def greedy_sample(name: str, grid: Grid, args: tuple) -> None:
    logits, vocab, tokens, logprobs = args
    rows = logits.reshape(-1, vocab)[: grid[0]]
    best = rows.max(axis=1)
    tokens[: grid[0]] = rows.argmax(axis=1)  # the lowest id among equal maxima
    logprobs[: grid[0]] = -numpy.log(numpy.exp(rows - best[:, None]).sum(axis=1))


REFERENCES: dict[str, Callable[[str, Grid, tuple], None]] = {
    "embedding": embedding,
    "add_rms_norm": add_rms_norm,
    "rotary": rotary,
    "reshape_and_cache": reshape_and_cache,
    "paged_decode_attention": paged_decode_attention,
    "paged_decode_reduce": paged_decode_reduce,
    "paged_prefill_attention": paged_prefill_attention,
    "silu_and_mul": silu_and_mul,
    "bias_add": bias_add,
    "greedy_sample": greedy_sample,
}


def reference(function: str) -> Callable[[str, Grid, tuple], None]:
    """The reference of a kernel's instantiation, e.g. add_rms_norm_bf16."""
    base = re.sub(r"(_(f32|f16|bf16))?(_d\d+)?$", "", function)
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

"""The paged KV pool, sized from a memory budget rather than from the context length."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from shared.errors import KvmeshError, Reason
from shared.sliding_window import most_window_blocks


@dataclass(frozen=True)
class KVCacheShape:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    # A sliding-window model whose sliding layers keep their window only: those layers, their
    # window, and the blocks of their own pool (block 0 of it never handed out: freed table
    # entries point there). Empty / 0 / 0: every layer in the one pool.
    window_layers: frozenset[int] = frozenset()
    window: int = 0
    num_window_blocks: int = 0

    @staticmethod
    def from_budget(
        arch: ModelArchitecture,
        block_size: int,
        budget_bytes: int,
        dtype: torch.dtype,
        window_requests: tuple[int, int] | None = None,
    ) -> KVCacheShape:
        """`window_requests`: (most requests at once, most tokens a step) where the sliding
        layers keep their window only (see window_split)."""
        element = torch.empty((), dtype=dtype).element_size()
        layer_block = 2 * arch.kv_size * element * block_size
        style = arch.style
        window_layers = style.sliding_layers if window_requests else frozenset()
        if len(window_layers) == arch.num_layers:  # no full layer to size the one pool by
            window_layers = frozenset()
        num_window_blocks = 0
        if window_requests and window_layers and style.sliding_window:
            max_seqs, step_tokens = window_requests
            num_window_blocks = window_split(
                budget_bytes // (layer_block * arch.num_layers),
                max_seqs * most_window_blocks(style.sliding_window, step_tokens, block_size),
                most_window_blocks(style.sliding_window, block_size, block_size),
            )
            budget_bytes -= num_window_blocks * layer_block * len(window_layers)
        num_full_layers = arch.num_layers - len(window_layers)
        num_blocks = max(budget_bytes, 0) // (layer_block * num_full_layers)
        if num_blocks < 2:
            raise KvmeshError(
                Reason.KV_CACHE_TOO_SMALL,
                f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{layer_block * num_full_layers} bytes; at least 2 are needed",
            )
        return KVCacheShape(
            num_blocks,
            block_size,
            arch.num_kv_heads,
            arch.head_dim,
            arch.num_layers,
            frozenset(window_layers) if num_window_blocks else frozenset(),
            (style.sliding_window or 0) if num_window_blocks else 0,
            num_window_blocks,
        )

    def blocks_of(self, layer: int) -> int:
        return self.num_window_blocks if layer in self.window_layers else self.num_blocks

    def num_bytes(self, element_bytes: int) -> int:
        layer_block = 2 * self.num_kv_heads * self.head_dim * self.block_size
        blocks = sum(self.blocks_of(layer) for layer in range(self.num_layers))
        return blocks * layer_block * element_bytes


def window_split(blocks_without_window: int, blocks_for_all: int, least_span: int) -> int:
    """The sliding layers' pool, in blocks: enough for every request at once to hold its
    largest span (blocks_for_all), but never more than the one pool would have given each layer
    (blocks_without_window), so the pool holds at least what it held before and the full
    layers' pool grows by the rest. At least three spans of a one-block step (a request's,
    a warm-up fixture's run beside it, and room for steps larger than a block; the scheduler
    cuts a prompt into pieces that fit), and the null block."""
    return max(min(blocks_for_all, blocks_without_window), 3 * least_span) + 1


def kv_cache_dtype(
    requested: torch.dtype | None, activations: torch.dtype, compiled: bool
) -> torch.dtype:
    """The pool's element type; `requested` None is auto. The compiled step (a packed model on
    the CPU) converts K and V as it writes and reads them, so its pool defaults to float16:
    half the bytes a decode step reads and a token keeps, as llama.cpp keeps its cache (decode
    attention 20% faster at batch 32; greedy parity and perplexity within their bounds, tested).
    The eager attention reads the pool in the activation dtype: any other needs the graph."""
    if requested is None:
        return torch.float16 if compiled else activations
    if requested != activations and not compiled:
        name = str(requested).removeprefix("torch.")
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            f"--kv-cache-dtype {name} needs the compiled CPU step (packed weights, --compile "
            f"auto, a C++ compiler); this engine runs eager, which reads the cache as its "
            f"activations ({str(activations).removeprefix('torch.')})",
        )
    return requested


class KVCache:
    """Per layer, K as (num_blocks, num_kv_heads, head_dim, block_size) and V as
    (num_blocks, num_kv_heads, block_size, head_dim): the layouts decode attention reads rows of
    (see attention.py). Each layer's K and V are tensors of their own, not views of one pool: a
    compiled graph that writes one layer's cache must not see every other layer alias it.
    """

    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: str = "cpu") -> None:
        self.shape = shape
        heads, size, dim = shape.num_kv_heads, shape.block_size, shape.head_dim
        layers = range(shape.num_layers)
        self.keys = [_zeros((shape.blocks_of(i), heads, dim, size), dtype, device) for i in layers]
        self.values = [
            _zeros((shape.blocks_of(i), heads, size, dim), dtype, device) for i in layers
        ]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Each (source, destination): the destination block becomes the source's copy, in
        every layer, K and V (a fork's own copy of its sibling's partial block)."""
        if pairs:
            self._check_whole_blocks()  # a fork: the scheduler makes none for such a model
            sources, destinations = (list(column) for column in zip(*pairs, strict=True))
            for tensor in (*self.keys, *self.values):
                tensor[destinations] = tensor[sources]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    def read_block(self, block_id: int) -> memoryview:
        """One block's K and V for every layer, contiguous: a KV tier's value (a copy of its
        own, which the pool's later writes never touch)."""
        self._check_whole_blocks()
        parts = [
            t[block_id].reshape(-1)
            for pair in zip(self.keys, self.values, strict=True)
            for t in pair
        ]
        return torch.cat(parts).view(torch.uint8).numpy().data

    def write_block(self, block_id: int, payload: bytes | memoryview) -> None:
        """The inverse of read_block: a loaded block into pool block `block_id`."""
        self._check_whole_blocks()
        with warnings.catch_warnings():  # read only here: no copy to make it writable
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=torch.uint8)
        offset = 0
        for pair in zip(self.keys, self.values, strict=True):
            for tensor in pair:
                block = tensor[block_id]
                size = block.numel() * block.element_size()
                block.copy_(flat[offset : offset + size].view(tensor.dtype).view(block.shape))
                offset += size

    def _check_whole_blocks(self) -> None:
        """A block id names every layer's K/V only where no layer keeps its window alone."""
        if self.shape.window_layers:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                "a sliding-window model keeping its window only (--sliding-window-kv window) "
                "has no whole blocks to store or hand over; serve it with "
                "--sliding-window-kv full",
            )

    @property
    def block_payload_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.keys, *self.values))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """On the CPU, zeros from calloc: pages the kernel zeroes as blocks are first written, not
    all at start (the default 1 GiB pool took 0.4-2 s to zero on a 2-core machine)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    zeroed = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(zeroed).view(dtype).view(shape)

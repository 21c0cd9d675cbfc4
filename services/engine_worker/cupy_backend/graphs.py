"""Decode steps as CUDA graphs: one captured forward per batch-size bucket, replayed.

A decode step of B requests runs the graph of the smallest bucket >= B. Each graph owns fixed
device buffers (ids, positions, slots, block tables as wide as the longest context, context
lengths) and its own workspace; a replay copies the step's host arrays into them, pads the rest
(slot -1 writes nothing, context 1 reads one position of block 0, rows nobody samples) and
launches the graph: one launch instead of ~15 per layer. Buckets are captured on first use, on
the runner's stream, after one eager warm-up run so every kernel is loaded and cuBLAS has
chosen its algorithms before capture.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import cupy
import numpy

from services.engine_worker.cupy_backend.batch import GpuBatch
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import num_splits
from services.engine_worker.cupy_backend.model import (
    CupyCausalLM,
    DeviceBatch,
    GpuKVCache,
    Workspace,
)

log = logging.getLogger("kvmesh.engine_worker.graphs")
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class DecodeGraph:
    def __init__(
        self,
        model: CupyCausalLM,
        cache: GpuKVCache,
        size: int,
        max_blocks: int,
        max_model_len: int,
        stream: cupy.cuda.Stream,
    ) -> None:
        self.size = size
        self.max_blocks = max_blocks
        arch = model.arch
        self.workspace = Workspace(arch, model.spec, size, size, size, num_splits(max_model_len))
        self.batch = DeviceBatch(
            input_ids=cupy.zeros(size, numpy.int32),
            positions=cupy.zeros(size, numpy.int32),
            slots=cupy.full(size, -1, numpy.int64),
            decode_block_tables=cupy.zeros((size, max_blocks), numpy.int32),
            decode_context_lens=cupy.ones(size, numpy.int32),
            prefill_block_tables=cupy.zeros((0, 1), numpy.int32),
            prefill_query_starts=cupy.zeros(1, numpy.int32),
            prefill_context_lens=cupy.zeros(0, numpy.int32),
            max_query_len=0,
            sample_rows=cupy.arange(size, dtype=numpy.int32),
            num_decodes=size,
        )
        started = time.perf_counter()
        with stream:
            model.forward(self.batch, cache, self.workspace)  # warm-up: loads, cuBLAS picks
            stream.synchronize()
            stream.begin_capture()
            try:
                self.logits = model.forward(self.batch, cache, self.workspace)
            finally:
                self.graph = stream.end_capture()
        log.info(
            "captured decode graph",
            extra={"batch_size": size, "ms": round((time.perf_counter() - started) * 1e3, 1)},
        )

    def replay(self, batch: GpuBatch, stream: cupy.cuda.Stream) -> Any:
        """Logits (B, vocab) of the step's B decode rows."""
        rows = batch.num_decodes
        padded = self.size - rows
        device = self.batch
        with stream:
            device.input_ids.set(_pad(batch.input_ids, padded, 0))
            device.positions.set(_pad(batch.positions, padded, 0))
            device.slots.set(_pad(batch.slots, padded, -1))
            device.decode_context_lens.set(_pad(batch.decode_context_lens, padded, 1))
            tables = numpy.zeros((self.size, self.max_blocks), numpy.int32)
            tables[:rows, : batch.decode_block_tables.shape[1]] = batch.decode_block_tables
            device.decode_block_tables.set(tables)
            self.graph.launch(stream)
        return self.logits[:rows]


def _pad(values: numpy.ndarray, count: int, fill: int) -> numpy.ndarray:
    return numpy.concatenate([values, numpy.full(count, fill, dtype=values.dtype)])


class DecodeGraphs:
    def __init__(
        self,
        model: CupyCausalLM,
        cache: GpuKVCache,
        max_model_len: int,
        stream: cupy.cuda.Stream,
        max_batch: int = BUCKETS[-1],
    ) -> None:
        self.model, self.cache, self.stream = model, cache, stream
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // cache.shape.block_size)
        self.buckets = tuple(b for b in BUCKETS if b <= max_batch)
        self.graphs: dict[int, DecodeGraph] = {}

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, batch: GpuBatch) -> Any | None:
        """The logits of a decode-only step through its bucket's graph; None when no bucket
        is large enough (the caller runs it eagerly)."""
        size = self.bucket(batch.num_decodes)
        if size is None:
            return None
        graph = self.graphs.get(size)
        if graph is None:
            graph = DecodeGraph(
                self.model, self.cache, size, self.max_blocks, self.max_model_len, self.stream
            )
            self.graphs[size] = graph
        return graph.replay(batch, self.stream)

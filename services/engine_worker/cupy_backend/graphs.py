"""Decode steps as CUDA graphs: one captured forward per batch-size bucket, replayed.

A decode step of B requests runs the graph of the smallest bucket >= B. Every bucket reads
one set of fixed input buffers (ids, positions, slots, block tables as wide as the longest
context, context lengths), sized for the largest bucket, and writes the runner's one
workspace; a replay copies the step's host arrays into the buffers, pads the rest (slot -1
writes nothing, context 1 reads one position of block 0, rows nobody samples) and launches
the graph: one launch instead of ~15 per layer.

Every bucket is captured when the runner loads, after one eager run of the same shapes so
every kernel is loaded and cuBLAS has chosen its algorithms. A bucket whose capture fails is
logged once with the reason and its steps run eagerly; `report()` says which buckets are
graphs and why any is not, for the manifest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import cupy
import numpy

from services.engine_worker.cupy_backend.batch import GpuBatch
from services.engine_worker.cupy_backend.model import CupyCausalLM, DeviceBatch, GpuKVCache
from services.engine_worker.cupy_backend.workspace import Workspace

log = logging.getLogger("kvmesh.engine_worker.graphs")
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclass(frozen=True)
class GraphInputs:
    """The fixed device buffers every bucket's graph reads, for up to `rows` decode rows."""

    input_ids: Any
    positions: Any
    slots: Any
    block_tables: Any  # (rows, max_blocks)
    context_lens: Any
    sample_rows: Any
    no_prefill: tuple[Any, Any, Any]  # block tables, query starts, context lengths

    @staticmethod
    def allocate(rows: int, max_blocks: int) -> GraphInputs:
        return GraphInputs(
            input_ids=cupy.zeros(rows, numpy.int32),
            positions=cupy.zeros(rows, numpy.int32),
            slots=cupy.full(rows, -1, numpy.int64),
            block_tables=cupy.zeros((rows, max_blocks), numpy.int32),
            context_lens=cupy.ones(rows, numpy.int32),
            sample_rows=cupy.arange(rows, dtype=numpy.int32),
            no_prefill=(
                cupy.zeros((0, 1), numpy.int32),
                cupy.zeros(1, numpy.int32),
                cupy.zeros(0, numpy.int32),
            ),
        )

    @staticmethod
    def num_bytes(rows: int, max_blocks: int) -> int:
        return rows * (4 + 4 + 8 + 4 * max_blocks + 4 + 4) + 4

    def batch(self, size: int, splits: int) -> DeviceBatch:
        """The first `size` rows as a decode-only batch (views: the graph reads the buffers)."""
        return DeviceBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slots=self.slots[:size],
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            prefill_block_tables=self.no_prefill[0],
            prefill_query_starts=self.no_prefill[1],
            prefill_context_lens=self.no_prefill[2],
            max_query_len=0,
            sample_rows=self.sample_rows[:size],
            num_decodes=size,
            decode_splits=splits,
        )

    def fill(self, batch: GpuBatch, size: int) -> None:
        """The step's rows, then padding up to the bucket's `size`: copies on the current
        stream, ordered before the graph's launch."""
        rows, width = batch.num_decodes, batch.decode_block_tables.shape[1]
        padded = size - rows
        self.input_ids[:size].set(_pad(batch.input_ids, padded, 0))
        self.positions[:size].set(_pad(batch.positions, padded, 0))
        self.slots[:size].set(_pad(batch.slots, padded, -1))
        self.context_lens[:size].set(_pad(batch.decode_context_lens, padded, 1))
        tables = numpy.zeros((size, self.block_tables.shape[1]), numpy.int32)
        tables[:rows, :width] = batch.decode_block_tables
        self.block_tables[:size].set(tables)


def _pad(values: numpy.ndarray, count: int, fill: int) -> numpy.ndarray:
    return numpy.concatenate([values, numpy.full(count, fill, dtype=values.dtype)])


def buckets_up_to(max_rows: int) -> tuple[int, ...]:
    return tuple(b for b in BUCKETS if b <= max_rows) or (BUCKETS[0],)


class DecodeGraphs:
    def __init__(
        self,
        model: CupyCausalLM,
        cache: GpuKVCache,
        workspace: Workspace,
        max_model_len: int,
        stream: Any,
        buckets: tuple[int, ...],
    ) -> None:
        self.model, self.cache, self.workspace, self.stream = model, cache, workspace, stream
        self.buckets = buckets
        max_blocks = -(-max_model_len // cache.shape.block_size)
        with stream:
            self.inputs = GraphInputs.allocate(self.buckets[-1], max_blocks)
        self.graphs: dict[int, tuple[Any, Any]] = {}  # bucket -> (graph, its logits view)
        self.failures: dict[int, str] = {}  # bucket -> why it runs eagerly

    def capture(self) -> None:
        """Every bucket, largest first: what fails is known before the first request."""
        started = time.perf_counter()
        for size in reversed(self.buckets):
            self._capture(size)
        log.info(
            "captured decode graphs",
            extra={
                "buckets": sorted(self.graphs),
                "eager": sorted(self.failures),
                "ms": round((time.perf_counter() - started) * 1e3, 1),
            },
        )

    def _capture(self, size: int) -> None:
        batch = self.inputs.batch(size, self.workspace.limits.max_splits)
        stream = self.stream
        with stream:
            self.model.forward(batch, self.cache, self.workspace)  # loads kernels, cuBLAS picks
            stream.synchronize()
            stream.begin_capture()
            try:
                logits = self.model.forward(batch, self.cache, self.workspace)
            except Exception as error:  # whatever the forward did that a capture cannot hold
                _end_abandoned(stream)
                self._failed(size, error)
                return
            try:
                graph = stream.end_capture()
            except Exception as error:  # the capture was invalidated along the way
                self._failed(size, error)
                return
        self.graphs[size] = (graph, logits)

    def _failed(self, size: int, error: Exception) -> None:
        reason = f"{type(error).__name__}: {error}".strip()
        self.failures[size] = reason
        log.warning(
            "decode graph capture failed: this bucket runs eagerly",
            extra={"batch_size": size, "reason": reason},
        )

    def report(self) -> dict[str, str]:
        """Each bucket: "graph", or the reason its capture failed."""
        return {
            str(size): "graph" if size in self.graphs else self.failures[size]
            for size in self.buckets
        }

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, batch: GpuBatch) -> Any | None:
        """The logits of a decode-only step through its bucket's graph; None when no bucket
        is large enough or its capture failed (the caller runs it eagerly)."""
        size = self.bucket(batch.num_decodes)
        captured = None if size is None else self.graphs.get(size)
        if size is None or captured is None:
            return None
        graph, logits = captured
        with self.stream:
            self.inputs.fill(batch, size)
            graph.launch(self.stream)
        return logits[: batch.num_decodes]


def _end_abandoned(stream: Any) -> None:
    """Ends a capture a failure interrupted, so the stream takes ordinary work again."""
    # An invalidated capture reports its error here too: already known.
    with contextlib.suppress(Exception):
        stream.end_capture()

"""Decode steps as CUDA graphs: one captured forward per batch-size bucket, replayed.

A decode step of B requests runs the graph of the smallest bucket >= B. Every bucket reads
its inputs from one packed device buffer (packed_inputs.py) and writes the runner's one
workspace, sampled tokens included: a steady step is one copy in, one graph launch, one copy
of the sampled tokens out and one synchronisation.

Every bucket is captured when the runner loads, after one eager run of the same shapes so
every kernel is loaded and cuBLAS has chosen its algorithms. A bucket whose capture fails is
logged once with the reason and its steps run eagerly; `report()` says which buckets are
graphs and why any is not, for the manifest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from services.engine_worker.cupy_backend.batch import GpuBatch
from services.engine_worker.cupy_backend.device_sampling import DeviceRows
from services.engine_worker.cupy_backend.kv_pool import GpuKVCache
from services.engine_worker.cupy_backend.model import CupyCausalLM
from services.engine_worker.cupy_backend.packed_inputs import PackedInputs
from services.engine_worker.cupy_backend.workspace import Workspace

log = logging.getLogger("kvmesh.engine_worker.graphs")
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


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
            self.inputs = PackedInputs(self.buckets[-1], max_blocks)
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
        batch = self.inputs.batch(size)
        stream = self.stream
        with stream:
            self.inputs.clear(size)  # padding rows in this bucket's layout
            self.model.forward_and_sample(batch, self.cache, self.workspace)  # loads, cuBLAS picks
            stream.synchronize()
            stream.begin_capture()
            try:
                logits = self.model.forward_and_sample(batch, self.cache, self.workspace)
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

    def run(self, batch: GpuBatch, sampling: DeviceRows) -> Any | None:
        """The logits of a decode-only step through its bucket's graph (sampled tokens in the
        workspace); None when no bucket is large enough or its capture failed (the caller runs
        it eagerly). The pinned inputs are free again once the step's results are read."""
        size = self.bucket(batch.num_decodes)
        captured = None if size is None else self.graphs.get(size)
        if size is None or captured is None:
            return None
        graph, logits = captured
        with self.stream:
            self.inputs.upload(batch, sampling, size, self.stream)
            graph.launch(self.stream)
        return logits[: batch.num_decodes]


def _end_abandoned(stream: Any) -> None:
    """Ends a capture a failure interrupted, so the stream takes ordinary work again."""
    # An invalidated capture reports its error here too: already known.
    with contextlib.suppress(Exception):
        stream.end_capture()

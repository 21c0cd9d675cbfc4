"""The cupy backend's KV pool: per layer K and V in one device array, read and loaded a block
at a time for the KV tiers and handovers."""

from __future__ import annotations

from typing import Any

import cupy
import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec
from services.engine_worker.kv_cache import KVCacheShape


class GpuKVCache:
    """Per layer K and V, each (num_blocks, kv_heads, block_size, head_dim): one pool."""

    def __init__(self, shape: KVCacheShape, spec: DTypeSpec, stream: Any = None) -> None:
        self.shape = shape
        self.stream = stream  # the steps' stream: a block read or loaded is ordered on it
        dims = (
            shape.num_layers,
            2,
            shape.num_blocks,
            shape.num_kv_heads,
            shape.block_size,
            shape.head_dim,
        )
        self.pool = cupy.zeros(dims, dtype=spec.storage)

    @property
    def num_bytes(self) -> int:
        return int(self.pool.nbytes)

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """As the torch KVCache's: each destination block becomes its source's copy."""
        if pairs:
            sources, destinations = (list(column) for column in zip(*pairs, strict=True))
            self.pool[:, :, destinations] = self.pool[:, :, sources]

    def layer(self, index: int) -> tuple[Any, Any]:
        return self.pool[index, 0], self.pool[index, 1]

    def read_block(self, block_id: int) -> bytes:
        """One block's K and V for every layer, contiguous, copied to the host after the
        steps queued before it."""
        with self.stream:
            block = cupy.asnumpy(cupy.ascontiguousarray(self.pool[:, :, block_id]))
            self.stream.synchronize()
        return bytes(block.tobytes())

    def write_block(self, block_id: int, payload: bytes | memoryview) -> None:
        shape = self.pool[:, :, block_id].shape
        host = numpy.frombuffer(payload, dtype=self.pool.dtype).reshape(shape)
        with self.stream:  # before the step that reads it, on the same stream
            self.pool[:, :, block_id] = cupy.asarray(host)
            self.stream.synchronize()  # `host` is a view of `payload`: done with it

    @property
    def block_payload_bytes(self) -> int:
        return int(self.pool[:, :, 0].nbytes)

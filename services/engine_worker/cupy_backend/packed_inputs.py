"""A decode step's inputs in one copy: pinned host memory -> one device buffer -> the graph.

Every decode bucket's graph reads its inputs from views at the start of one device buffer,
laid out for that bucket's row count: ids, positions and context lengths (int32 each), slots
(int64), each row's sampling parameters (sample_tokens.ROW_FIELDS), block tables (int32,
rows x max_blocks), then room for the step's penalty and bias adjustments. A step writes its
rows and the padding into the same layout in pinned host memory and sends the bucket's bytes,
up to its last adjustment, in one asynchronous copy, ordered on the steps' stream before the
graph's launch. Padding: slot -1 writes nothing, context 1 reads one position of block 0,
and nobody samples those rows. The pinned buffer is free again once the step's results are
read (the runner's synchronisation).
"""

from __future__ import annotations

import functools
from typing import Any

import cupy
import numpy

from services.engine_worker.cupy_backend.batch import GpuBatch
from services.engine_worker.cupy_backend.device_sampling import MAX_ADJUSTMENTS, DeviceRows
from services.engine_worker.cupy_backend.kernels.sample_tokens import (
    ADJUSTMENT_WIDTH,
    ROW_FIELDS,
    SamplingRows,
)
from services.engine_worker.cupy_backend.model import DeviceBatch

_ROW_FIELDS = (  # name, dtype, values per row (0: the table's width)
    ("input_ids", numpy.int32, 1),
    ("positions", numpy.int32, 1),
    ("context_lens", numpy.int32, 1),
    ("slots", numpy.int64, 1),
    *((name, dtype, 1) for name, dtype, _ in ROW_FIELDS),
    ("block_tables", numpy.int32, 0),
)
_PADDING = {
    "input_ids": 0,
    "positions": 0,
    "context_lens": 1,
    "slots": -1,
    **{name: value for name, _, value in ROW_FIELDS},
}
_ADJUSTMENT_BYTES = 4 * ADJUSTMENT_WIDTH


@functools.cache  # one layout per bucket size: worked out once, not every step
def _layout(rows: int, max_blocks: int) -> dict[str, tuple[int, int, Any]]:
    """name -> (byte offset, values, dtype) for a batch of `rows` rows; 16-byte aligned, the
    adjustments last."""
    layout, offset = {}, 0
    for name, dtype, per_row in _ROW_FIELDS:
        count = rows * (per_row or max_blocks)
        offset = -(-offset // 16) * 16
        layout[name] = (offset, count, dtype)
        offset += count * numpy.dtype(dtype).itemsize
    values = MAX_ADJUSTMENTS * ADJUSTMENT_WIDTH
    layout["adjustments"] = (-(-offset // 16) * 16, values, numpy.float32)
    return layout


def _end(rows: int, max_blocks: int, adjustments: int = MAX_ADJUSTMENTS) -> int:
    """Bytes up to the end of the `adjustments`-th adjustment."""
    return _layout(rows, max_blocks)["adjustments"][0] + adjustments * _ADJUSTMENT_BYTES


class PackedInputs:
    """The pinned staging buffer and the device buffer every bucket's graph reads."""

    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        nbytes = _end(max_rows, max_blocks)
        self._pinned = cupy.cuda.alloc_pinned_memory(nbytes)  # kept alive with the views
        self.host = numpy.frombuffer(self._pinned, numpy.uint8, nbytes)
        self.device = cupy.empty(nbytes, numpy.uint8)
        self.sample_rows = cupy.arange(max_rows, dtype=numpy.int32)
        self.no_prefill = (
            cupy.zeros((0, 1), numpy.int32),
            cupy.zeros(1, numpy.int32),
            cupy.zeros(0, numpy.int32),
        )

    @staticmethod
    def num_bytes(max_rows: int, max_blocks: int) -> int:
        """Device bytes (the pinned host buffer is as large): inputs and sampled row ids."""
        return _end(max_rows, max_blocks) + 4 * max_rows + 4

    def _views(self, buffer: Any, rows: int) -> dict[str, Any]:
        views = {}
        for name, (offset, count, dtype) in _layout(rows, self.max_blocks).items():
            view = buffer[offset : offset + count * numpy.dtype(dtype).itemsize].view(dtype)
            if name == "block_tables":
                view = view.reshape(rows, self.max_blocks)
            elif name == "adjustments":
                view = view.reshape(MAX_ADJUSTMENTS, ADJUSTMENT_WIDTH)
            views[name] = view
        return views

    def batch(self, rows: int) -> DeviceBatch:
        """A decode-only batch of `rows` rows over the device buffer (what a graph captures)."""
        views = self._views(self.device, rows)
        sampling = {name: views[name] for name, _, _ in ROW_FIELDS}
        return DeviceBatch(
            input_ids=views["input_ids"],
            positions=views["positions"],
            slots=views["slots"],
            decode_block_tables=views["block_tables"],
            decode_context_lens=views["context_lens"],
            prefill_block_tables=self.no_prefill[0],
            prefill_query_starts=self.no_prefill[1],
            prefill_context_lens=self.no_prefill[2],
            max_query_len=0,
            sample_rows=self.sample_rows[:rows],
            num_decodes=rows,
            sampling=SamplingRows(**sampling, adjustments=views["adjustments"]),
        )

    def clear(self, rows: int) -> None:
        """Padding in every row of a `rows` batch (what its graph is captured over), copied
        now. Each batch size has its own layout of the same buffer."""
        views = self._views(self.host, rows)
        for name, value in _PADDING.items():
            views[name][:] = value
        views["block_tables"][:] = 0
        end = _end(rows, self.max_blocks, adjustments=0)
        self.device[:end].set(self.host[:end])

    def upload(self, batch: GpuBatch, sampling: DeviceRows, rows: int, stream: Any) -> None:
        """The step's rows, their sampling parameters and adjustments, then padding up to
        `rows`, in one copy on `stream`."""
        views = self._views(self.host, rows)
        count, width = batch.num_decodes, batch.decode_block_tables.shape[1]
        for name, source in (
            ("input_ids", batch.input_ids),
            ("positions", batch.positions),
            ("context_lens", batch.decode_context_lens),
            ("slots", batch.slots),
            *sampling.arrays.items(),
        ):
            views[name][:count] = source
            views[name][count:] = _PADDING[name]
        tables = views["block_tables"]
        tables[:count, :width] = batch.decode_block_tables
        tables[:count, width:] = 0
        tables[count:] = 0
        used = sampling.adjustments.shape[0]
        views["adjustments"][:used] = sampling.adjustments
        end = _end(rows, self.max_blocks, adjustments=used)
        self.device[:end].set(self.host[:end], stream=stream)

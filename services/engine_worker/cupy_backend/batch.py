"""One step's scheduled requests as the flat host arrays the GPU kernels read.

Decodes (one new token) come first, then prefill chunks, each request's tokens contiguous, as
in the torch batch. Block tables are padded to a common width: the decode kernel reads only as
far as each context, so the padding (block 0) is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from services.engine_worker.step_inputs import RequestState, flatten


@dataclass(frozen=True)
class GpuBatch:
    input_ids: numpy.ndarray  # int32 (T,)
    positions: numpy.ndarray  # int32 (T,)
    slots: numpy.ndarray  # int64 (T,) block * block_size + offset
    decode_block_tables: numpy.ndarray  # int32 (D, width)
    decode_context_lens: numpy.ndarray  # int32 (D,)
    prefill_block_tables: numpy.ndarray  # int32 (P, width)
    prefill_query_starts: numpy.ndarray  # int32 (P + 1,) rows in the batch
    prefill_context_lens: numpy.ndarray  # int32 (P,)
    max_query_len: int
    sample_rows: numpy.ndarray  # int32 (S,)
    sampling_states: tuple[RequestState, ...]  # (S,) in sample_rows order

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decodes(self) -> int:
        return int(self.decode_context_lens.shape[0])

    @property
    def decode_only(self) -> bool:
        """Every row a decode that samples: the shape a captured CUDA graph replays."""
        return self.prefill_context_lens.shape[0] == 0 and self.sample_rows.shape[0] == (
            self.num_decodes
        )


def _table(block_lists: list[list[int]], width: int) -> numpy.ndarray:
    table = numpy.zeros((len(block_lists), max(width, 1)), dtype=numpy.int32)
    for row, blocks in enumerate(block_lists):
        table[row, : len(blocks)] = blocks
    return table


def _widened(table: numpy.ndarray, width: int) -> numpy.ndarray:
    """The decode rows' tables at least `width` wide (a captured graph's fixed width)."""
    if table.shape[1] >= width:
        return table
    wide = numpy.zeros((table.shape[0], width), dtype=numpy.int32)
    wide[:, : table.shape[1]] = table
    return wide


def build_gpu_batch(
    scheduled: list[tuple[RequestState, int]],
    block_size: int,
    decode_width: int = 0,
    tables: numpy.ndarray | None = None,
) -> GpuBatch:
    """decode_width: block-table width for decode rows (0: as wide as this step needs);
    `tables`: the worker's block tables (persistent_batch.py)."""
    flat = flatten(scheduled, block_size, tables)
    positions = numpy.asarray(flat.positions, dtype=numpy.int64)
    slots = (
        numpy.asarray(flat.token_blocks, dtype=numpy.int64) * block_size + positions % block_size
    )
    query_lens = numpy.diff(numpy.asarray(flat.prefill_query_starts, dtype=numpy.int64))
    return GpuBatch(
        input_ids=numpy.asarray(flat.input_ids, dtype=numpy.int32),
        positions=positions.astype(numpy.int32),
        slots=slots,
        decode_block_tables=_widened(flat.decode_table, decode_width),
        decode_context_lens=numpy.asarray(flat.decode_context_lens, dtype=numpy.int32),
        prefill_block_tables=_table(
            flat.prefill_blocks, max((len(b) for b in flat.prefill_blocks), default=1)
        ),
        prefill_query_starts=numpy.asarray(flat.prefill_query_starts, dtype=numpy.int32),
        prefill_context_lens=numpy.asarray(flat.prefill_context_lens, dtype=numpy.int32),
        max_query_len=int(query_lens.max()) if query_lens.size else 0,
        sample_rows=numpy.asarray(flat.sample_rows, dtype=numpy.int32),
        sampling_states=tuple(flat.sampling_states),
    )

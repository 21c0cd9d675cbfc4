"""One step's scheduled requests as the flat host arrays the GPU kernels read.

Decodes (one new token) come first, then prefill chunks, each request's tokens contiguous, as
in the torch batch. Block tables are padded to a common width: the decode kernel reads only as
far as each context, so the padding (block 0) is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from services.engine_worker.batch import RequestState


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


def build_gpu_batch(
    scheduled: list[tuple[RequestState, int]], block_size: int, decode_width: int = 0
) -> GpuBatch:
    """decode_width: block-table width for decode rows (0: as wide as this step needs)."""
    decodes = [(s, n) for s, n in scheduled if n == 1]
    prefills = [(s, n) for s, n in scheduled if n > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sampling_states: list[RequestState] = []

    def add_tokens(state: RequestState, start: int, stop: int) -> None:
        input_ids.extend(state.token_ids[start:stop])
        positions.extend(range(start, stop))
        slots.extend(
            state.block_ids[p // block_size] * block_size + p % block_size
            for p in range(start, stop)
        )
        if stop == len(state.token_ids):
            sample_rows.append(len(input_ids) - 1)
            sampling_states.append(state)

    decode_blocks, decode_lens = [], []
    for state, _ in decodes:
        position = state.num_computed_tokens
        add_tokens(state, position, position + 1)
        decode_blocks.append(state.block_ids[: position // block_size + 1])
        decode_lens.append(position + 1)
    prefill_blocks, prefill_lens, query_starts = [], [], [len(input_ids)]
    max_query_len = 0
    for state, num_new in prefills:
        start = state.num_computed_tokens
        context = start + num_new
        add_tokens(state, start, context)
        prefill_blocks.append(state.block_ids[: -(-context // block_size)])
        prefill_lens.append(context)
        query_starts.append(len(input_ids))
        max_query_len = max(max_query_len, num_new)
    return GpuBatch(
        input_ids=numpy.asarray(input_ids, dtype=numpy.int32),
        positions=numpy.asarray(positions, dtype=numpy.int32),
        slots=numpy.asarray(slots, dtype=numpy.int64),
        decode_block_tables=_table(
            decode_blocks, decode_width or max((len(b) for b in decode_blocks), default=1)
        ),
        decode_context_lens=numpy.asarray(decode_lens, dtype=numpy.int32),
        prefill_block_tables=_table(
            prefill_blocks, max((len(b) for b in prefill_blocks), default=1)
        ),
        prefill_query_starts=numpy.asarray(query_starts, dtype=numpy.int32),
        prefill_context_lens=numpy.asarray(prefill_lens, dtype=numpy.int32),
        max_query_len=max_query_len,
        sample_rows=numpy.asarray(sample_rows, dtype=numpy.int32),
        sampling_states=tuple(sampling_states),
    )

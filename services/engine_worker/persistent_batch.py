"""The worker's requests kept as a persistent batch: each held request owns a row of one block
table array from the step that admits it to the step that forgets it.

A plan carries only the blocks a request appends, so its row changes by those few writes; a step
then takes its decode rows' tables with one gather (`step_inputs.gather_tables`) instead of
building a list per row and a tensor from them (360 µs a step at batch 128 on a 2-vCPU EPYC,
before). The rows mirror each
`RequestState.block_ids`: the test in tests/engine_worker/test_persistent_batch.py rebuilds the
batch from scratch after every step of a randomized workload and compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy

from services.engine_worker.step_inputs import RequestState
from services.engine_worker.window_blocks import WindowBlocks

_FIRST_ROWS = 64  # doubled whenever a request finds none free


class BlockTables:
    """Row `state.slot` holds `state.block_ids`; entries past them are stale, never read."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.table = numpy.zeros((_FIRST_ROWS, width), dtype=numpy.int32)
        self._free = list(range(_FIRST_ROWS - 1, -1, -1))
        self.window_blocks: WindowBlocks | None = None  # a held request's go back with its row

    def add(self, state: RequestState) -> None:
        if not self._free:
            rows = self.table.shape[0]
            self.table = numpy.concatenate([self.table, numpy.zeros_like(self.table)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        state.slot = self._free.pop()
        self.write(state, 0, state.block_ids)

    def extend(self, state: RequestState, new_block_ids: Sequence[int]) -> None:
        """Before `state.apply`: the blocks a plan appends to it."""
        if new_block_ids and state.slot >= 0:
            self.write(state, len(state.block_ids), new_block_ids)

    def write(self, state: RequestState, start: int, block_ids: Sequence[int]) -> None:
        if start + len(block_ids) > self.width:
            raise ValueError(
                f"{state.request_id}: {start + len(block_ids)} blocks exceed the context's "
                f"{self.width}"
            )
        self.table[state.slot, start : start + len(block_ids)] = block_ids

    def remove(self, state: RequestState) -> None:
        if state.slot >= 0:
            self._free.append(state.slot)
            state.slot = -1
        if self.window_blocks is not None:
            self.window_blocks.release(state)


class HeldRequests(dict[str, RequestState]):
    """The worker's requests by id; each holds a row of `tables` while it is here, however it
    leaves (finished, failed, a lease's end, the scheduler's stream closing).

    A request that failed is remembered until a plan lists it as finished: a scheduler that
    plans one step ahead has planned it again before it learnt of the failure."""

    def __init__(self, tables: BlockTables) -> None:
        super().__init__()
        self.tables = tables
        self.failed: set[str] = set()

    def drop_failed(self, request_id: str) -> None:
        self.pop(request_id)
        self.failed.add(request_id)

    def running(self, request_id: str) -> RequestState | None:
        """A running request's state; None for one that failed (KeyError for one never here)."""
        return None if request_id in self.failed else self[request_id]

    @classmethod
    def for_context(cls, max_model_len: int, block_size: int) -> HeldRequests:
        """Rows as wide as a request of max_model_len tokens, and a block for a draft's
        overhang."""
        return cls(BlockTables(-(-max_model_len // block_size) + 1))

    def __setitem__(self, request_id: str, state: RequestState) -> None:
        if (old := self.get(request_id)) is not None:
            self.tables.remove(old)
        self.failed.discard(request_id)
        self.tables.add(state)
        super().__setitem__(request_id, state)

    def __delitem__(self, request_id: str) -> None:
        self.tables.remove(self[request_id])
        super().__delitem__(request_id)

    def pop(self, request_id: str, default: Any = None) -> Any:
        self.failed.discard(request_id)
        state = super().pop(request_id, default)
        if isinstance(state, RequestState):
            self.tables.remove(state)
        return state

    def clear(self) -> None:
        for state in self.values():
            self.tables.remove(state)
        self.failed.clear()
        super().clear()

"""The window blocks of a sliding-window model's sliding layers: which ids a request holds.

The scheduler counts these blocks and never names them (services/scheduler/window_budget.py);
the worker hands out the ids here, by the rule both share (shared/sliding_window.py). A request's
`window_ids` has an entry per block of its context: the blocks of its span hold its ids, and
every entry behind the span points at block 0, which is never handed out and never written, so
a freed entry reads zeros (masked out by the window) rather than another request's K/V.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.step_inputs import RequestState
from shared.config import EngineConfig
from shared.errors import KvmeshError, Reason
from shared.sliding_window import window_span

NULL_BLOCK = 0


def window_requests(config: EngineConfig, backend: str) -> tuple[int, int] | None:
    """(most requests at once, most tokens a step) to size the window pool for, or None where
    every layer keeps the whole context: --sliding-window-kv full, the cupy backend (whose
    layer is Llama's), or KV tiers on (a tier's block holds every layer's K/V)."""
    if config.cache.sliding_window_kv != "window" or backend != "torch":
        return None
    if config.kv_tiers.enabled:
        return None
    limits = config.scheduler
    return limits.max_num_seqs, limits.max_num_batched_tokens


class WindowBlocks:
    @classmethod
    def of(cls, shape: KVCacheShape) -> WindowBlocks | None:
        if not shape.num_window_blocks:
            return None
        return cls(shape.num_window_blocks, shape.window, shape.block_size)

    def __init__(self, num_blocks: int, window: int, block_size: int) -> None:
        self.window = window
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def cover(self, scheduled: Iterable[tuple[RequestState, int]]) -> None:
        """Before a step: each request's span for the tokens it computes, freed behind it (and
        past it: a rejected draft's block) first, so the step's requests share what was freed.
        A request holds one run of blocks, so only the entries leaving it are visited. Raises
        INTERNAL where the scheduler's count was exceeded (a bug: the request fails)."""
        spans = []
        for state, num_new in scheduled:
            computed = state.num_computed_tokens
            first, stop = window_span(computed, computed + num_new, self.window, self.block_size)
            ids = state.window_ids
            index = min(first, len(ids)) - 1
            while index >= 0 and ids[index] != NULL_BLOCK:  # behind the window
                self._free.append(ids[index])
                ids[index] = NULL_BLOCK
                index -= 1
            self._free += (b for b in ids[stop:] if b != NULL_BLOCK)  # past it
            del ids[stop:]
            spans.append((ids, first, stop))
        for ids, first, stop in spans:
            ids += [NULL_BLOCK] * (stop - len(ids))
            for index in range(first, stop):
                if ids[index] == NULL_BLOCK:
                    if not self._free:
                        raise KvmeshError(
                            Reason.INTERNAL, "the sliding layers' window blocks ran out"
                        )
                    ids[index] = self._free.pop()

    def release(self, state: RequestState) -> None:
        """A request leaves the worker: every block it holds goes back."""
        self._free += (b for b in state.window_ids if b != NULL_BLOCK)
        state.window_ids = []

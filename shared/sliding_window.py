"""The KV a sliding layer keeps: the scheduler counts it and the engine-worker allocates it by
the same rule, so the count is what the worker holds.

A sliding layer (Gemma 2 and 3) attends to its last `window` positions, its own included. Its
K/V lives in a pool of its own ("window blocks"): a step computing positions [computed, end)
holds the blocks from the one with position computed - window + 1 up to the one with end - 1,
and every block before that goes back to the pool, so a request keeps about window / block_size
+ 1 blocks per sliding layer however long its context grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.pb.kvmesh.v1 import common_pb2


def window_span(computed: int, end: int, window: int, block_size: int) -> tuple[int, int]:
    """The block indices [first, stop) a step computing positions [computed, end) holds: its
    first query reads back to position computed - window + 1."""
    first = max(0, computed - window + 1) // block_size
    stop = -(-max(end, computed) // block_size)
    return first, max(first, stop)


def most_window_blocks(window: int, max_step_tokens: int, block_size: int) -> int:
    """The most blocks one request's span takes: a window behind a step of max_step_tokens."""
    return -(-(window - 1 + max_step_tokens) // block_size) + 1


@dataclass(frozen=True)
class WindowPool:
    """A worker's window blocks, as the scheduler plans with them (from its ModelInfo)."""

    window: int  # positions a sliding layer sees
    num_blocks: int  # window blocks the scheduler may hand out

    def most_step_tokens(self, block_size: int) -> int:
        """The largest step of one request whose span fits the pool (so a request alone always
        runs): the inverse of most_window_blocks."""
        return (self.num_blocks - 1) * block_size - self.window + 1


def window_pool_of(model: common_pb2.ModelInfo) -> WindowPool | None:
    """From a worker's ModelInfo (its sliding_window and kv_window_blocks fields)."""
    if not model.sliding_window:
        return None
    return WindowPool(model.sliding_window, model.kv_window_blocks)

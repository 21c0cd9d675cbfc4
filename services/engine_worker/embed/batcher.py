"""Continuous batching for embeddings: inputs queue; while one batch runs, the next gathers.

A batch takes queued inputs in arrival order until the padded batch (inputs x longest) would
pass `max_batch_tokens`; one input longer than that still runs, alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

EmbedFn = Callable[[list[list[int]]], Awaitable[list[list[float]]]]


class EmbedBatcher:
    def __init__(self, embed: EmbedFn, max_batch_tokens: int = 16384) -> None:
        self._embed = embed
        self.max_batch_tokens = max_batch_tokens
        self._queue: deque[tuple[list[int], asyncio.Future[list[float]]]] = deque()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run())
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in inputs]
        self._queue.extend(zip(inputs, futures, strict=True))
        self._wake.set()
        return list(await asyncio.gather(*futures))

    def _next_batch(self) -> list[tuple[list[int], asyncio.Future[list[float]]]]:
        batch: list[tuple[list[int], asyncio.Future[list[float]]]] = []
        longest = 0
        while self._queue:
            ids, future = self._queue[0]
            if future.done():  # its caller went away
                self._queue.popleft()
                continue
            padded = (len(batch) + 1) * max(longest, len(ids))
            if batch and padded > self.max_batch_tokens:
                break
            self._queue.popleft()
            batch.append((ids, future))
            longest = max(longest, len(ids))
        return batch

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while batch := self._next_batch():
                try:
                    vectors = await self._embed([ids for ids, _ in batch])
                except Exception as error:  # the whole batch fails alike
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (_, future), vector in zip(batch, vectors, strict=True):
                    if not future.done():
                        future.set_result(vector)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

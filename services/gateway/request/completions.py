"""A request's n completions relayed as one stream of events, each tagged with its index.

Each completion has its own relay (detokenizer, stop strings, usage, terminal event, fail-over);
with n > 1 they run side by side and their events interleave in the order they are ready. The
stream ends when every completion has ended; closing it cancels whatever still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from services.gateway.request.request_record import Admitted, Progress
from services.gateway.request.text_stream import TextStream
from shared.pb.kvmesh.v1 import inference_pb2

Event = inference_pb2.GenerateEvent
T = TypeVar("T")


@dataclass
class Completion:
    """One of a request's completions: its placements (the current one last), its text and
    its progress."""

    index: int
    placed: list[Admitted]
    text: TextStream
    progress: Progress

    @property
    def admitted(self) -> Admitted:
        return self.placed[-1]


async def merged(
    completions: list[Completion], relay: Callable[[Completion], AsyncIterator[Event]]
) -> AsyncGenerator[tuple[Completion, Event], None]:
    """Every completion's events; one completion is relayed in place, with no task."""
    if len(completions) == 1:
        async for event in relay(completions[0]):
            yield completions[0], event
        return
    async for index, event in interleaved([relay(c) for c in completions]):
        yield completions[index], event


async def interleaved(sources: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Each source's items with its index, as they are ready: every source is iterated in a
    task of its own from its first item on, so a generator's context stays in one task. A
    source's exception is raised here; closing this cancels every source still running."""
    ready: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                ready.put_nowait((index, item))
        except Exception as error:  # handed to the consumer, which raises it
            ready.put_nowait((index, error))
        finally:
            ready.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            index, item = await ready.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

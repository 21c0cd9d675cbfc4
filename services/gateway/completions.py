"""A request's n completions relayed as one stream of events, each tagged with its index.

Each completion has its own relay (detokenizer, stop strings, usage, terminal event, fail-over);
with n > 1 they run side by side and their events interleave in the order they are ready. The
stream ends when every completion has ended; closing it cancels whatever still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from services.gateway.request_record import Admitted, Progress
from services.gateway.text_stream import TextStream
from shared.pb.kvmesh.v1 import inference_pb2

Event = inference_pb2.GenerateEvent


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
    ready: asyncio.Queue[tuple[Completion, Event | BaseException | None]] = asyncio.Queue()

    async def pump(completion: Completion) -> None:
        try:
            async for event in relay(completion):
                ready.put_nowait((completion, event))
        except Exception as error:  # handed to the consumer, which raises it
            ready.put_nowait((completion, error))
        finally:
            ready.put_nowait((completion, None))

    tasks = [asyncio.create_task(pump(completion)) for completion in completions]
    try:
        running = len(tasks)
        while running:
            completion, item = await ready.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield completion, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

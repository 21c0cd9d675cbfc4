"""A bidi stream this gateway shares among its requests, each request a lane of it.

What lanes send joins an outbox; one writer sends all that queued while the last write was in
flight as one message, so a step's worth of lanes crosses in one message. The stream opens on
first use and again after a break; a subclass reads the replies (`_read`) and says what a
break does to its lanes. `DetokenizeLanes` (to the tokenizer) and `SubmitLanes` (to each
scheduler) are the two.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeAlias, TypeVar

import grpc

Call: TypeAlias = grpc.aio.StreamStreamCall
Entry = TypeVar("Entry")


class SharedStream(ABC, Generic[Entry]):
    def __init__(self, open_call: Callable[[], Call], message: Callable[[list[Entry]], Any]):
        self._open_call = open_call  # a new stream
        self._message = message  # the request message carrying a batch of entries
        self._call: Call | None = None
        self._outbox: list[Entry] = []
        self._writer: asyncio.Task[None] | None = None
        self._writing_to: Call | None = None  # the stream self._writer writes to
        self._tasks: set[asyncio.Task[None]] = set()

    @abstractmethod
    async def _read(self, call: Call) -> None:
        """Hands each lane its replies until `call` ends; then `_forget(call)`."""

    async def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _open(self) -> Call:
        if self._call is None:
            self._call = self._open_call()
            self._hold(asyncio.create_task(self._read(self._call)))
        return self._call

    def _hold(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """Kept referenced until it ends (the loop holds tasks weakly), and cancelled at close."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _send(self, entry: Entry) -> None:
        self._outbox.append(entry)
        if self._writer is None or self._writer.done() or self._writing_to is not self._call:
            # Started, not run: the other lanes' entries of this loop turn join its message.
            self._writing_to = self._call
            self._writer = self._hold(asyncio.create_task(self._write(self._call)))

    async def _write(self, call: Call | None) -> None:
        """Until the outbox is empty; a writer for a broken stream stops at its next turn."""
        try:
            while self._outbox and self._call is call and call is not None:
                batch, self._outbox = self._outbox, []
                await call.write(self._message(batch))
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the reader sees the same break and reads the call's status

    def _forget(self, broken: Call) -> bool:
        """Whether `broken` was the current stream, now forgotten with what was queued for it."""
        broken.cancel()  # a no-op once it ended
        if self._call is not broken:
            return False
        self._call = None
        self._outbox.clear()  # all of it was for this stream
        return True

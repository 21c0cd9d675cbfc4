"""What a Generate handler reads of its caller, whether gRPC or the OpenAI HTTP front.

A gRPC `ServicerContext` already has both methods; `HttpCall` gives an HTTP request the same
shape, so both fronts share one admission, auth, tracing and relay path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

# Writes choice `index`'s delta of text now when its client can take it, counting its
# tokens; False when it cannot (the delta then goes as an event, through the request's task).
TextSink = Callable[[int, str, int], bool]


class CallContext(Protocol):
    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...

    def time_remaining(self) -> float | None: ...


class HttpCall:
    """An HTTP request as a call: its headers as metadata (lower-case names, as gRPC has
    them: `authorization`, `traceparent`) and an optional deadline."""

    def __init__(self, headers: Sequence[tuple[str, str]], timeout_s: float | None = None):
        self._metadata = tuple((name.lower(), value) for name, value in headers)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.text_sink: TextSink | None = None  # set by a stream whose chunks can be plain text

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())


def text_sink(context: CallContext) -> TextSink | None:
    """The caller's sink for plain text deltas; a gRPC call has none."""
    return getattr(context, "text_sink", None)


def time_remaining(context: CallContext, timeout_ms: int) -> float | None:
    """Seconds left: the sooner of the client's gRPC deadline and the request's timeout_ms."""
    remaining = context.time_remaining()
    if timeout_ms:
        remaining = timeout_ms / 1e3 if remaining is None else min(remaining, timeout_ms / 1e3)
    return remaining

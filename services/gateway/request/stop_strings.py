"""Stop strings: the bounds a request's list must keep, and matching on streamed text across
token boundaries.

Text that could be the start of a stop string is held back until the next text settles it, so
a client never sees a piece of a stop string; on a match, the text is cut before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.errors import KvmeshError, Reason

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def check_stop_strings(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
        )
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters",
            )


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.matched: str | None = None
        self._held = ""  # a suffix that is a prefix of some stop string

    def push(self, text: str) -> str:
        """Text that is safe to release. After a match it returns the text before the match,
        sets `matched`, and releases nothing more."""
        if self.matched is not None:
            return ""
        buffer = self._held + text
        earliest: tuple[int, str] | None = None
        for stop in self.stops:
            index = buffer.find(stop)
            if index >= 0 and (earliest is None or index < earliest[0]):
                earliest = (index, stop)
        if earliest is not None:
            self.matched = earliest[1]
            self._held = ""
            return buffer[: earliest[0]]
        hold = max((self._partial_suffix(buffer, stop) for stop in self.stops), default=0)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """At the end of the stream: the held-back text never became a stop string."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    @staticmethod
    def _partial_suffix(buffer: str, stop: str) -> int:
        for length in range(min(len(stop) - 1, len(buffer)), 0, -1):
            if buffer.endswith(stop[:length]):
                return length
        return 0

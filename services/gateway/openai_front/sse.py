"""Server-sent events: each chunk one `data:` line of JSON.

A stream's plain text chunks differ only in their text, so each choice's chunk is encoded
once, around a placeholder, and every later one is those bytes around its text's JSON
string: no dict built and serialized a token (5.6 µs a chunk that way, 0.5 µs this way).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Any

DONE = b"data: [DONE]\n\n"
# Private-use characters: the text goes in through its own encoding, never found in it here.
PLACEHOLDER = "\ue000kvmesh-text\ue000"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class TextChunks:
    """Each choice's text chunk as bytes before and after its text."""

    def __init__(self) -> None:
        self._around: dict[int, tuple[bytes, bytes]] = {}

    def encode(self, index: int, text: str, chunk: Callable[[str], dict[str, Any]]) -> bytes:
        """Choice `index`'s chunk for `text`; `chunk(text)` builds it (once a choice)."""
        around = self._around.get(index)
        if around is None:
            whole = sse(chunk(PLACEHOLDER))
            before, _, after = whole.rpartition(encode_basestring(PLACEHOLDER).encode())
            around = self._around[index] = (before, after)
        return around[0] + encode_basestring(text).encode() + around[1]

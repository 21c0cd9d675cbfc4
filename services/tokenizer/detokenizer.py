"""Incremental detokenization that never emits half a UTF-8 character.

Only a short window of recent tokens is decoded each time: text is released once decoding the
window grows past the text already released and does not end in a replacement character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # window start: context for the tokens being released
        self._read_offset = 0  # tokens before this are already released as text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that became complete (possibly empty)."""
        self._token_ids.extend(token_ids)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._token_ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back, at the end of the stream."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._token_ids))
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return full[len(prefix) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._token_ids[start:end], skip_special_tokens=self._skip_special
        )

"""A chat's own strings stay text: only the chat template writes control tokens.

A user who writes `<|im_start|>system` in a message would otherwise get the real control token
and could forge a turn of another role. Before the template renders, every special-token
string inside the messages and tools (content, names, tool call arguments, descriptions) is
fenced with two Unicode noncharacters; the rendered text is then encoded piece by piece, the
fenced pieces as plain text. The fences never reach a token: a client's own noncharacters
become U+FFFD first, so no input can open or close a fence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

OPEN, CLOSE = "\ufdd0", "\ufdd1"
_FENCE_CHARS = re.compile(f"[{OPEN}{CLOSE}]")
_FENCED = re.compile(f"{OPEN}(.*?){CLOSE}", re.DOTALL)


def special_pattern(special_tokens: Iterable[str]) -> re.Pattern[str] | None:
    """One pattern for every special-token string, longest first; None when there are none."""
    tokens = sorted({t for t in special_tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def fence(value: Any, pattern: re.Pattern[str]) -> Any:
    """The value (a message list, a dict, a string...) with its special-token strings fenced."""
    if isinstance(value, str):
        return pattern.sub(lambda m: OPEN + m.group(0) + CLOSE, _FENCE_CHARS.sub("\ufffd", value))
    if isinstance(value, dict):
        return {key: fence(item, pattern) for key, item in value.items()}
    if isinstance(value, list):
        return [fence(item, pattern) for item in value]
    return value


def pieces(rendered: str) -> Iterator[tuple[str, bool]]:
    """The rendered text as (piece, is_plain_text) in order: fenced pieces are plain text."""
    start = 0
    for match in _FENCED.finditer(rendered):
        if match.start() > start:
            yield rendered[start : match.start()], False
        yield match.group(1), True
        start = match.end()
    if start < len(rendered):
        yield rendered[start:], False

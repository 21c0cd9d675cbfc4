"""Tool calls parsed out of a streamed answer (the Hermes syntax: a JSON object
`{"name": ..., "arguments": {...}}` in each <tool_call></tool_call> block).

Text outside the blocks is the answer's content and streams on at once, but for a tail that
may be the start of an opening tag; a block is held until its closing tag arrives and then
leaves as one whole call. The closing tag counts only outside a JSON string: an argument may
hold "</tool_call>" itself. A block that is not a call of a known tool (`auto` lets the model
write anything) stays in the content as written. Under `required` or a named function the
grammar allowed nothing else, so a call whose arguments fail their schema is a bug, reported
as INVALID_OUTPUT, as a response format's output check does.

A block still open at the finish (cut by a length or a stop string) leaves as a call when its
body parses as one and is dropped otherwise: its markup never reaches the content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from services.gateway.request.output_check import schema_problem
from services.gateway.request.tools import ToolUse
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2
from shared.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# What can change the scan's state: outside a string a quote or a tag's "<"; inside, a quote
# or an escape.
_OUTSIDE_STRING, _INSIDE_STRING = re.compile(r'["<]'), re.compile(r'["\\]')


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (it may be completed later)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.pending = ""  # held back: a possible opening tag, or an open block's body
        self.inside = False  # within a <tool_call> block
        self.scanned = 0  # how far into an open block's body the closing tag was looked for
        self.in_string = False  # ... and whether that point is inside a JSON string
        # Whitespace at the end of the content so far: the syntax puts newlines between and
        # around calls, which are not content, so it waits to see what follows.
        self.blank = ""
        self.after_call = False  # the last thing out was a call: leading whitespace is not content
        self.calls: list[common_pb2.ToolCall] = []

    def push(self, text: str) -> tuple[str, list[common_pb2.ToolCall]]:
        """The content that can go out now, and the calls completed by `text`."""
        self.pending += text
        content: list[str] = []
        calls: list[common_pb2.ToolCall] = []
        while True:
            if not self.inside:
                at = self.pending.find(TOOL_CALL_OPEN)
                if at < 0:
                    cut = len(self.pending) - _partial_tag(self.pending, TOOL_CALL_OPEN)
                    self._content(self.pending[:cut], content)
                    self.pending = self.pending[cut:]
                    break
                self._content(self.pending[:at], content)
                self.pending, self.inside = self.pending[at + len(TOOL_CALL_OPEN) :], True
                self.scanned, self.in_string = 0, False
            else:
                end = self._closing_tag()
                if end < 0:
                    break
                self._close_block(end, content, calls)
        self.calls.extend(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[common_pb2.ToolCall]]:
        """What is still held back: an unclosed block as a call if it parses as one (else
        nothing), and whitespace when no call followed it as content."""
        content: list[str] = []
        calls: list[common_pb2.ToolCall] = []
        if self.inside:
            call = self._call(self.pending, cut=True)
            calls += [] if call is None else [call]
        elif len(self.pending) < 2:  # a lone "<" is text; "<t" on is a call's start, cut
            self._content(self.pending, content)
        self.pending, self.inside = "", False
        self.calls.extend(calls)
        if not self.calls:
            content.append(self.blank)
        self.blank = ""
        return "".join(content), calls

    def _closing_tag(self) -> int:
        """Where the open block's closing tag starts, outside any JSON string; -1 until it
        has arrived whole."""
        text, at = self.pending, self.scanned
        while True:
            found = (_INSIDE_STRING if self.in_string else _OUTSIDE_STRING).search(text, at)
            if found is None:
                self.scanned = len(text)
                return -1
            at = found.start()
            if text[at] == "\\":
                if at + 1 == len(text):  # what it escapes has not arrived
                    self.scanned = at
                    return -1
                at += 2
            elif text[at] == '"':
                self.in_string = not self.in_string
                at += 1
            elif text.startswith(TOOL_CALL_CLOSE, at):
                return at
            elif TOOL_CALL_CLOSE.startswith(text[at:]):  # may complete later
                self.scanned = at
                return -1
            else:
                at += 1

    def _close_block(self, end: int, content: list[str], calls: list[common_pb2.ToolCall]) -> None:
        body = self.pending[:end]
        self.pending, self.inside = self.pending[end + len(TOOL_CALL_CLOSE) :], False
        call = self._call(body)
        if call is None:
            self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE, content)
        else:
            calls.append(call)
            self.blank, self.after_call = "", True

    def _content(self, text: str, out: list[str]) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        body = text.rstrip()
        if body:
            out.append(self.blank + body)
            self.blank = text[len(body) :]
        else:
            self.blank += text

    def _call(self, body: str, cut: bool = False) -> common_pb2.ToolCall | None:
        """The block's call; None for one that is not a call (or, `cut` short, not whole)."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            value = None
        name = value.get("name") if isinstance(value, dict) else None
        arguments = _arguments(value.get("arguments", {})) if isinstance(value, dict) else None
        if name not in self.use.schemas or arguments is None:
            if self.use.constrained and not cut:
                raise KvmeshError(Reason.INVALID_OUTPUT, f"not a call of a tool: {body!r}")
            return None
        if self.use.constrained:
            problem = schema_problem(json.dumps(self.use.schemas[name]), arguments)
            if problem is not None and cut:
                return None
            if problem is not None:
                raise KvmeshError(Reason.INVALID_OUTPUT, f"{name}'s arguments: {problem}")
        return common_pb2.ToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            name=name,
            arguments=json.dumps(arguments, ensure_ascii=False),
        )


def _arguments(value: Any) -> dict[str, Any] | None:
    """A call's arguments as an object; some models write them as a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None

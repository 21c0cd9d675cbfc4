"""Detokenizing lanes: one request's incremental detokenizer, its span and its count.

A `Detokenize` stream is one lane; a `DetokenizeLanes` stream carries many, each opened by its
first message and closed by `finish`, by a close, or when the stream ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import Counter

from services.tokenizer.detokenizer import IncrementalDetokenizer
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import tokenizer_pb2
from shared.text_tokenizer import TextTokenizer

log = logging.getLogger("kvmesh.tokenizer")
tracer = trace.get_tracer("kvmesh.tokenizer")
TOKENS = Counter("kvmesh_tokenizer_tokens", "Tokens encoded and detokenized", ["direction"])


class Lane:
    """One request's detokenizing: `held` (a drain's count) is entered now and left when the
    lane ends, however it ends."""

    def __init__(
        self,
        tokenizer: TextTokenizer | None,
        parent: otel_context.Context,
        held: contextlib.AbstractContextManager[None],
    ) -> None:
        self.tokenizer = tokenizer
        # A model without a tokenizer still serves token-id clients: no text.
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer else None
        self.span = tracer.start_span("tokenizer.Detokenize", parent, SpanKind.SERVER)
        self._held = held
        held.__enter__()
        self.num_tokens, self.busy_s, self.ended = 0, 0.0, False

    def answer(self, message: tokenizer_pb2.DetokenizeRequest) -> tokenizer_pb2.DetokenizeResponse:
        """The text `message`'s tokens complete, and its pieces' bytes; `finish` ends the lane."""
        started = time.perf_counter()
        detokenizer, tokenizer = self.detokenizer, self.tokenizer
        text = detokenizer.push(message.token_ids) if detokenizer else ""
        if message.finish and detokenizer:
            text += detokenizer.flush()
        pieces = (
            tokenizer.token_bytes(list(message.piece_ids))
            if tokenizer and message.piece_ids
            else []
        )
        self.num_tokens += len(message.token_ids)
        self.busy_s += time.perf_counter() - started
        if message.finish:
            self.end()  # the work is done; the reply's send is the caller's wait
        return tokenizer_pb2.DetokenizeResponse(text=text, pieces=pieces)

    def end(self) -> None:
        """One span for the lane, however it ends: none per token."""
        if self.ended:
            return
        self.ended = True
        TOKENS.labels("detokenize").inc(self.num_tokens)
        self.span.set_attributes(
            {"gen_ai.usage.output_tokens": self.num_tokens, "kvmesh.busy_ms": self.busy_s * 1e3}
        )
        self.span.end()
        self._held.__exit__(None, None, None)


class Lanes:
    """The lanes of one `DetokenizeLanes` stream, by the caller's numbers. A lane's failure
    (an unknown model, a tokenizer that raised) closes that lane only: the stream carries
    every request of a gateway."""

    def __init__(self, open_lane: Callable[[tokenizer_pb2.DetokenizeLane], Lane]) -> None:
        self._open_lane = open_lane
        self._lanes: dict[int, Lane] = {}

    def answer(
        self, message: tokenizer_pb2.DetokenizeLanesRequest
    ) -> tokenizer_pb2.DetokenizeLanesResponse:
        reply = tokenizer_pb2.DetokenizeLanesResponse()
        for entry in message.lanes:  # in order: a push, then a close of the same lane
            if entry.close:
                self._end(entry.lane)
                continue
            try:
                lane = self._lanes.get(entry.lane)
                if lane is None:
                    lane = self._lanes[entry.lane] = self._open_lane(entry)
                answer = lane.answer(entry.request)
            except Exception as error:  # the lane fails, not the stream
                self._end(entry.lane)
                reply.lanes.add(lane=entry.lane, error=grpc_errors.to_pb(_lane_failure(error)))
                continue
            if lane.ended:
                del self._lanes[entry.lane]
            reply.lanes.add(lane=entry.lane, response=answer)
        return reply

    def end_all(self) -> None:
        for lane in self._lanes.values():
            lane.end()
        self._lanes.clear()

    def _end(self, number: int) -> None:
        lane = self._lanes.pop(number, None)
        if lane is not None:
            lane.end()


def _lane_failure(error: Exception) -> KvmeshError:
    if isinstance(error, KvmeshError):
        return error
    log.exception("detokenizing failed", exc_info=error)
    return KvmeshError(Reason.INTERNAL, f"detokenizing failed: {type(error).__name__}")

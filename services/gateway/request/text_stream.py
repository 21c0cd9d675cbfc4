"""Incremental detokenization of one request: its lane on the gateway's shared
`DetokenizeLanes` stream (detokenize_lanes.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from services.gateway.mesh.detokenize_lanes import Call, DetokenizeLanes
from shared import grpc_errors
from shared.pb.kvmesh.v1 import common_pb2, tokenizer_pb2


class TextStream:
    def __init__(self, lanes: DetokenizeLanes, model: str = "", traceparent: str = "") -> None:
        self._lanes = lanes
        self._lane = lanes.new_lane()
        self._model = model  # whose tokenizer: said in the lane's first message
        self._traceparent = traceparent  # the tokenizer's span for the lane hangs under it
        self._call: Call | None = None  # the stream the lane opened on
        self._ended = False
        self.wait_s = 0.0  # time spent waiting on the tokenizer, for the trace

    async def push(
        self,
        token_ids: list[int],
        *,
        finish: bool = False,
        logprobs: Sequence[common_pb2.TokenLogprobs] = (),
    ) -> str:
        """The text these tokens completed. With `logprobs`, also fills in each entry's (and
        each alternative's) `token_bytes` from the same round trip."""
        started = time.monotonic()
        piece_ids = [
            i for entry in logprobs for i in (entry.token_id, *(t.token_id for t in entry.top))
        ]
        entry = self.entry(token_ids, finish=finish, piece_ids=piece_ids)
        try:
            answered = await self._lanes.exchange(entry, self._lanes.stream(self._call))
        finally:
            self.wait_s += time.monotonic() - started
        text = self.take(answered, finish=finish)
        pieces = iter(answered.response.pieces)
        for logprob in logprobs:
            logprob.token_bytes = next(pieces, b"")
            for top in logprob.top:
                top.token_bytes = next(pieces, b"")
        return text

    @property
    def lanes(self) -> DetokenizeLanes:
        return self._lanes

    def entry(
        self, token_ids: list[int], *, finish: bool = False, piece_ids: Sequence[int] = ()
    ) -> tokenizer_pb2.DetokenizeLane:
        """The lane's next message; raises TOKENIZER_LOST when its stream broke since."""
        entry = tokenizer_pb2.DetokenizeLane(lane=self._lane)
        request = entry.request  # filled in place: half the cost of building it and copying
        request.SetInParent()
        request.token_ids.extend(token_ids)
        if finish:
            request.finish = True
        if piece_ids:
            request.piece_ids.extend(piece_ids)
        if self._call is None:
            entry.request.model = self._model
            entry.traceparent = self._traceparent
        # The lane's stream is known before the wait: a request cancelled during its first
        # push still closes the lane it opened.
        self._call = self._lanes.stream(self._call)
        return entry

    def take(self, answered: tokenizer_pb2.DetokenizedLane, *, finish: bool = False) -> str:
        """The text of the tokenizer's answer to `entry`; raises the error it answered."""
        if answered.HasField("error"):
            self._ended = True  # the tokenizer closed the lane
            raise grpc_errors.from_pb(answered.error)
        self._ended = finish
        return answered.response.text

    def cancel(self) -> None:
        """The request ended before its finish: the tokenizer forgets the lane."""
        if self._call is not None and not self._ended:
            self._lanes.close(self._lane, self._call)
        self._ended = True

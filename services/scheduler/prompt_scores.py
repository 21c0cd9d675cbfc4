"""Prompt logprobs on their way to the gateway: collected chunk by chunk as the worker
scores a prompt, sent whole with the request's first token.

A request preempted before its first token recomputes its prompt and the worker scores the
same positions again: each position is kept once. After the first token nothing more is
taken (a later recompute scores positions already sent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.scheduler.request import Request
from shared.outputs import RequestOutput
from shared.step import PromptLogprobs, TokenLogprobs


class PromptScores:
    def __init__(self) -> None:
        self._pending: dict[str, list[TokenLogprobs]] = {}  # request id -> positions 1, 2...

    def add(self, scores: Sequence[PromptLogprobs], requests: Mapping[str, Request]) -> None:
        """A step's scores, before its tokens are appended (a request with output has sent)."""
        for chunk in scores:
            request = requests.get(chunk.request_id)
            if request is None or request.num_tokens > request.prompt_len:
                continue
            entries = self._pending.setdefault(chunk.request_id, [])
            already = len(entries) + 1 - chunk.first_position  # positions it holds already
            if already >= 0:
                entries.extend(chunk.logprobs[already:])

    def attach(self, outputs: Sequence[RequestOutput]) -> None:
        """Each pending request's scores onto its first output with a token."""
        if not self._pending:
            return
        for output in outputs:
            if output.request_id in self._pending and output.new_token_ids:
                output.prompt_logprobs = tuple(self._pending.pop(output.request_id))

    def take(self, request_id: str) -> tuple[TokenLogprobs, ...]:
        """A request that ends with its first token: its scores, before its end forgets them."""
        return tuple(self._pending.pop(request_id, ()))

    def forget(self, request_id: str) -> None:
        """It ended (finished, aborted, failed): what it held is dropped."""
        self._pending.pop(request_id, None)

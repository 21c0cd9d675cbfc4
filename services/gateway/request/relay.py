"""One accepted request's upstream events turned into client events, one method per event.

The scheduler's per-step tokens go through the request's Detokenize stream (never half a UTF-8
character), then through the stop-string matcher, which may end the request early: cancelling
its lane aborts it upstream and frees its blocks. Every path ends with a usage event and
exactly one terminal event. A request split between a prefill and a decode pair is relayed
from one then the other: the prefill pair's `finished` carries a handover ticket, and the relay
goes on reading the decode pair's stream (handover.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from services.gateway.request.output_check import check_output
from services.gateway.request.request_record import (
    Admitted,
    Progress,
    completed_event,
    upstream_failure,
)
from services.gateway.request.stop_strings import StopStringMatcher
from services.gateway.request.text_stream import TextStream
from services.gateway.request.tool_calls import ToolCallParser
from services.gateway.request.tools import ToolUse
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, scheduler_pb2

log = logging.getLogger("kvmesh.gateway.relay")
# Places a prefilled request on a decode pair: (prefilled, ticket, its first tokens) -> that.
HandOver = Callable[[Admitted, scheduler_pb2.HandoverTicket, list[int]], Awaitable[Admitted]]
Event = inference_pb2.GenerateEvent
# Waits while the step pass relays the tokens (parked_relays.py); the events it could not.
Park = Callable[["Relay"], Awaitable[list[Event]]]
# Failures another scheduler may not have: its worker or it died, or it is draining.
FAILOVER_REASONS = (Reason.WORKER_LOST, Reason.MODEL_NOT_READY, Reason.UNREACHABLE)


class FailOver(Exception):
    """A retryable failure before the first token: the request may be placed again."""

    def __init__(self, error: KvmeshError) -> None:
        super().__init__(error.message)
        self.error = error


class Relay:
    def __init__(
        self,
        stops: list[str],
        admitted: Admitted,
        text: TextStream,
        progress: Progress,
        tools: ToolUse | None = None,
        hand_over: HandOver | None = None,
        park: Park | None = None,
    ) -> None:
        self.admitted = admitted
        self.hand_over = hand_over
        self.first_ids: list[int] = []  # sampled by a prefill pair, sent on to the decode pair
        self.text = text
        self.progress = progress
        self.stops = StopStringMatcher(stops)
        self.tool_calls = ToolCallParser(tools) if tools is not None and tools.parsed else None
        # A response format's whole text, checked once it finished.
        self.output: list[str] | None = [] if admitted.sampling.response_format else None
        self.ended = False
        self.may_fail_over = False  # set by the handler while another attempt is allowed
        sampling = admitted.sampling
        plain = self.tool_calls is None and self.output is None and sampling.logprobs is None
        self.park = park if plain and sampling.prompt_logprobs is None else None

    async def events(self) -> AsyncIterator[Event]:
        try:
            while not self.ended:
                if (park := self._parking()) is not None:
                    for out in await park(self):
                        yield out
                    continue
                event = await self.admitted.submit.read()
                kind = "eof" if event is grpc.aio.EOF else event.WhichOneof("event")
                if kind == "finished" and event.finished.HasField("handover") and self.hand_over:
                    await self._hand_over(self.hand_over, event.finished.handover)
                    continue
                if kind == "tokens":
                    handled = self.on_tokens(event.tokens)
                elif kind == "finished":
                    handled = self.on_finished(event.finished)
                elif kind == "failed":
                    self._fail_over_if_allowed(grpc_errors.from_pb(event.failed))
                    handled = self.on_failed(event.failed)
                else:
                    raise KvmeshError(
                        Reason.WORKER_LOST, "the scheduler ended the stream early", retryable=True
                    )
                async for out in handled:
                    yield out
        except (grpc.RpcError, KvmeshError) as error:
            failure = upstream_failure(error, emitted=self.progress.first_token_at is not None)
            self._fail_over_if_allowed(failure)
            async for out in self.on_broken(failure):
                yield out

    async def _hand_over(self, hand_over: HandOver, ticket: scheduler_pb2.HandoverTicket) -> None:
        """On to the decode pair; the prefill pair's stream closes either way, which ends its
        lease (the decode pair pulled the blocks before accepting, or never will)."""
        prefilled = self.admitted
        try:
            self.admitted = await hand_over(prefilled, ticket, self.first_ids)
        finally:
            prefilled.submit.cancel()
            prefilled.routed.ended()

    def _parking(self) -> Park | None:
        """A plain stream past its first delta parks while nothing but tokens comes (those
        unread go with it: a relay behind would else never park); on a prefill pair it waits
        for its handover (a decode pair's stream parks)."""
        admitted = self.admitted
        if self.progress.first_token_at is None or not admitted.submit.only_tokens_unread:
            return None
        return None if admitted.prefill_only else self.park

    def _fail_over_if_allowed(self, error: KvmeshError) -> None:
        """Never after the first token: the client would see tokens twice, or other ones."""
        if (
            self.may_fail_over
            and self.progress.first_token_at is None
            and error.retryable
            and error.reason in FAILOVER_REASONS
        ):
            self.ended = True
            raise FailOver(error)

    async def on_tokens(self, tokens: scheduler_pb2.SubmitTokens) -> AsyncIterator[Event]:
        ids = list(tokens.token_ids)
        self._counted(ids, tokens.first if tokens.HasField("first") else None)
        prompt_scores = self._prompt_scores(tokens)
        entries = [*prompt_scores, *tokens.logprobs]  # their bytes from the same round trip
        released = self.stops.push(await self.text.push(ids, logprobs=entries))
        for event in self._delta_events(tokens.logprobs, ids, prompt_scores, released):
            yield event

    def on_text(
        self, ids: list[int], text: str, deliver: Callable[[str, int], bool]
    ) -> list[Event]:
        """A parked relay's tokens (ids alone: a plain stream past its first token) with their
        text: handed to `deliver` (a plain delta the client can take at once), else the events
        to relay."""
        self._counted(ids)
        released = self.stops.push(text)
        if self.stops.matched is None and deliver(released, len(ids)):
            return []
        return self._delta_events((), ids, [], released)

    def _counted(
        self, ids: list[int], first: scheduler_pb2.FirstTokenTimings | None = None
    ) -> None:
        """The tokens counted in the progress (`first`: the first tokens' timings)."""
        progress = self.progress
        progress.completion_tokens += len(ids)
        if self.admitted.prefill_only:
            self.first_ids += ids
        if first is not None and progress.first_timings is None:
            progress.first_timings = first
            progress.cached_tokens = first.cached_tokens
        self.admitted.routed.started()

    def _delta_events(
        self,
        logprobs: Sequence[common_pb2.TokenLogprobs],
        ids: list[int],
        prompt_scores: list[common_pb2.TokenLogprobs],
        released: str,
    ) -> list[Event]:
        progress = self.progress
        if self.output is not None:
            self.output.append(released)
        first = progress.first_token_at is None
        progress.first_token_at = progress.first_token_at or time.monotonic()
        content, calls = self._split_calls(released, finish=self.stops.matched is not None)
        delta = inference_pb2.Delta(text=content, token_ids=ids, first_token=first)
        if logprobs or calls or prompt_scores:  # empty fields cost 2 µs a token to set
            delta.logprobs.extend(logprobs)
            delta.tool_calls.extend(calls)
            delta.prompt_logprobs.extend(prompt_scores)
        events = [Event(delta=delta)]
        if self.stops.matched is not None:
            self.ended = True
            self.admitted.submit.cancel()  # aborts upstream: blocks free within a step
            events.append(Event(usage=progress.usage()))
            events.append(
                self._completed(common_pb2.FINISH_REASON_STOP_STRING, self.stops.matched, None)
            )
        return events

    async def on_finished(self, finished: scheduler_pb2.SubmitFinished) -> AsyncIterator[Event]:
        self.ended = True
        self.progress.cached_tokens = finished.cached_tokens
        released = self.stops.push(await self.text.push([], finish=True))
        matched = self.stops.matched
        if matched is None:
            released += self.stops.flush()
        content, calls = self._split_calls(released, finish=True)
        if content or calls:
            yield Event(delta=inference_pb2.Delta(text=content, tool_calls=calls))
        # Ended by the grammar, not cut short by a length or a stop string: the whole text.
        response_format = self.admitted.sampling.response_format
        whole = finished.finish_reason == common_pb2.FINISH_REASON_STOP and matched is None
        if self.output is not None and response_format is not None and whole:
            check_output(response_format, "".join(self.output) + released)
        yield Event(usage=self.progress.usage())
        if finished.finish_reason == common_pb2.FINISH_REASON_ABORT:
            cancelled = inference_pb2.Cancelled(reason="abort", usage=self.progress.usage())
            yield Event(cancelled=cancelled)
            return
        reason = finished.finish_reason if matched is None else common_pb2.FINISH_REASON_STOP_STRING
        yield self._completed(reason, matched or "", finished)

    def _prompt_scores(self, tokens: scheduler_pb2.SubmitTokens) -> list[common_pb2.TokenLogprobs]:
        """The prompt's logprobs when they came: an entry for its first token (which has
        none) leads, so there is one per prompt token."""
        asked = self.admitted.sampling.prompt_logprobs is not None
        if not tokens.prompt_logprobs and not (asked and self.progress.first_token_at is None):
            return []  # a one-token prompt has no scored positions, but still its entry
        first = common_pb2.TokenLogprobs(token_id=self.admitted.token_ids[0])
        return [first, *tokens.prompt_logprobs]

    def _split_calls(self, text: str, finish: bool) -> tuple[str, list[common_pb2.ToolCall]]:
        """The text's content and the tool calls it completes (none when tools are not
        parsed); at the finish, with whatever the parser still held."""
        if self.tool_calls is None:
            return text, []
        content, calls = self.tool_calls.push(text)
        if finish:
            tail, last_calls = self.tool_calls.finish()
            content, calls = content + tail, calls + last_calls
        return content, calls

    def _completed(
        self, reason: FinishReason, stop_string: str, finished: scheduler_pb2.SubmitFinished | None
    ) -> Event:
        """The terminal event, with the answer's tool calls: a natural end after calls is
        finish reason TOOL_CALLS."""
        calls = self.tool_calls.calls if self.tool_calls is not None else []
        if calls and reason == common_pb2.FINISH_REASON_STOP:
            reason = common_pb2.FINISH_REASON_TOOL_CALLS
        event = completed_event(reason, stop_string, finished, self.progress, self.admitted)
        event.completed.tool_calls.extend(calls)
        return event

    async def on_failed(self, error: common_pb2.Error) -> AsyncIterator[Event]:
        self.ended = True
        yield Event(usage=self.progress.usage())
        yield Event(failed=inference_pb2.Failed(error=error))

    async def on_broken(self, failure: KvmeshError) -> AsyncIterator[Event]:
        """The upstream call broke (or a check failed) after acceptance."""
        self.ended = True
        log.warning("failed", extra={"reason": failure.reason.value, "error": failure.message})
        yield Event(usage=self.progress.usage())
        yield Event(failed=inference_pb2.Failed(error=grpc_errors.to_pb(failure)))

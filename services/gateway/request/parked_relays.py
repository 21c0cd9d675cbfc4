"""Plain streams relayed from one pass a step, not a task a request.

Past its first delta, a stream with no logprobs, tools or response format whose client can take
a chunk at once (the HTTP front's SSE writer) parks its relay: its lane hands its tokens to
the gateway's `StepPass` instead of waking the request's task. The pass sends every parked
stream's tokens to the tokenizer as one message, then for each stream runs the stop strings
and writes its chunk, as vLLM's output processor handles a step's outputs in one loop: at one
token a delta the per-request chain (two task wake-ups, four generators and two event
messages) cost the gateway more than the rest of its work. Anything else (the finish, a
failure, a stop string's match, a client not reading) wakes the task, which relays it as
before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter

from services.gateway.mesh.submit_lanes import LaneCall
from services.gateway.request.relay import Event, Relay
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import tokenizer_pb2

log = logging.getLogger("kvmesh.gateway.relay")
PASS_DELTAS = Counter(
    "kvmesh_gateway_step_pass_deltas", "Deltas the step pass wrote, without their request's task"
)
# Writes a delta's text (and counts its tokens) when the client takes it at once; else False.
Deliver = Callable[[str, int], bool]


class ParkedRelay:
    """A relay waiting on its lane's divert: the pass relays its tokens meanwhile."""

    def __init__(self, step_pass: StepPass, relay: Relay, deliver: Deliver) -> None:
        self._pass = step_pass
        self.relay = relay
        self.deliver = deliver
        self.lane: LaneCall = relay.admitted.submit
        self.waiting: list[int] | None = None  # token ids not yet sent to the tokenizer
        self.busy = False  # its tokens are with the tokenizer or being delivered
        self.interrupted = False
        self.woken: asyncio.Future[list[Event]] = asyncio.get_running_loop().create_future()

    def take(self, token_ids: Iterable[int]) -> None:
        if self.waiting is not None:
            self.waiting.extend(token_ids)
            return
        self.waiting = list(token_ids)
        if not self.busy:  # else the pass sends them once the exchange in flight is done
            self._pass.ready(self)

    def interrupt(self) -> None:
        self.interrupted = True
        if not self.busy and self.waiting is None:
            self.wake([])

    def wake(self, events: list[Event]) -> None:
        """Back to the task with `events` to relay first; tokens not yet relayed go back to
        the lane, ahead of whatever interrupted."""
        if self.woken.done():
            return
        self.lane.undivert(self.waiting)
        self.waiting = None
        self.woken.set_result(events)

    def fail(self, error: BaseException) -> None:
        if not self.woken.done():
            self.lane.undivert()
            self.woken.set_exception(error)


class StepPass:
    """The gateway's parked relays: the tokens that reached them in one loop turn (a step's,
    as the scheduler sends a step as one message) go to the tokenizer as one message, then to
    each one's delivery. A relay has one exchange at a time: tokens that reach it meanwhile
    join its next."""

    def __init__(self) -> None:
        self._ready: list[ParkedRelay] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def park(self, deliver: Deliver) -> Callable[[Relay], asyncio.Future[list[Event]]]:
        """A relay's `park`: its lane diverted to this pass until the task is woken."""

        def parked(relay: Relay) -> asyncio.Future[list[Event]]:
            waiting = ParkedRelay(self, relay, deliver)
            waiting.woken.add_done_callback(lambda _: _left(waiting))
            waiting.lane.divert_to(waiting)
            return waiting.woken

        return parked

    def ready(self, parked: ParkedRelay) -> None:
        if not self._ready:
            asyncio.get_running_loop().call_soon(self._send)
        self._ready.append(parked)

    def _send(self) -> None:
        ready, self._ready = self._ready, []
        batch: list[tuple[ParkedRelay, list[int]]] = []
        entries = []
        for parked in ready:
            tokens, parked.waiting = parked.waiting, None
            if parked.woken.done() or tokens is None:
                continue
            try:
                entries.append(parked.relay.text.entry(tokens))
            except KvmeshError as error:
                parked.fail(error)
                continue
            parked.busy = True
            batch.append((parked, tokens))
        if batch:
            task = asyncio.create_task(self._relay(batch, entries))
            self._tasks.add(task)  # the loop holds tasks weakly
            task.add_done_callback(self._tasks.discard)

    async def _relay(
        self,
        batch: list[tuple[ParkedRelay, list[int]]],
        entries: list[tokenizer_pb2.DetokenizeLane],
    ) -> None:
        lanes = batch[0][0].relay.text.lanes  # a gateway has one DetokenizeLanes
        started = time.monotonic()
        try:
            answers = await lanes.exchange_all(entries, lanes.stream(None))
        except BaseException as error:
            for parked, _ in batch:
                parked.busy = False
                parked.fail(error if isinstance(error, KvmeshError) else _internal(error))
            if isinstance(error, KvmeshError):
                return  # each task raises it, as its own push would have
            raise
        waited = time.monotonic() - started
        delivered = 0
        for (parked, tokens), answered in zip(batch, answers, strict=True):
            parked.relay.text.wait_s += waited
            if not parked.woken.done():  # else its task left: cancelled, or failed meanwhile
                delivered += self._deliver(parked, tokens, answered)
            parked.busy = False
            if parked.woken.done():
                continue
            if parked.interrupted and parked.waiting is None:
                parked.wake([])
            elif parked.waiting is not None:
                self.ready(parked)
        PASS_DELTAS.inc(delivered)

    @staticmethod
    def _deliver(
        parked: ParkedRelay,
        tokens: list[int],
        answered: tokenizer_pb2.DetokenizedLane,
    ) -> bool:
        """Whether the stream's text was written; else its task is woken with the events it
        needs relayed (a stop string's cancel interrupts meanwhile, and waits for this)."""
        try:
            relay = parked.relay
            events = relay.on_text(tokens, relay.text.take(answered), parked.deliver)
        except KvmeshError as error:  # the tokenizer's answer for it was an error
            parked.fail(error)
            return False
        except Exception as error:
            log.exception("the step pass failed a request")
            parked.fail(_internal(error))
            return False
        if events:
            parked.wake(events)
        return not events


def _left(parked: ParkedRelay) -> None:
    """The task left its park (woken or cancelled): the lane's reader takes its events."""
    if parked.lane.divert is parked:
        parked.lane.undivert(parked.waiting)
        parked.waiting = None


def _internal(error: BaseException) -> KvmeshError:
    return KvmeshError(Reason.INTERNAL, f"the step pass failed: {error!r}")

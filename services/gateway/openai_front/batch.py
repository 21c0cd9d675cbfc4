"""A completions batch (`prompt` as a list of prompts) served as one stream of events.

Each prompt is its own request through the same handler (admission, rate limits, routing),
side by side. The stream opens with one Accepted once every prompt is accepted (the first
prompt's id, every prompt's tokens), so a prompt that is refused fails the whole batch
before any byte goes out, and the others are cancelled upstream. Then each prompt's events,
their index moved to the choice's: prompt i's completion j is choice i * n + j.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from services.gateway.request.call_context import HttpCall
from services.gateway.request.completions import interleaved
from services.gateway.request.generate import GenerateHandler
from shared.pb.kvmesh.v1 import inference_pb2

Event = inference_pb2.GenerateEvent


async def batch_events(
    generate: GenerateHandler, requests: list[inference_pb2.GenerateRequest], call: HttpCall
) -> AsyncGenerator[Event, None]:
    streams = [generate(request, call) for request in requests]
    opened: list[Event | None] = [None] * len(streams)
    held: list[Event] = []  # events that came before every prompt was accepted
    async with contextlib.aclosing(interleaved(streams)) as events:
        async for prompt, event in events:
            if opened[prompt] is None:  # each prompt's first event is its Accepted
                opened[prompt] = event
                if all(first is not None for first in opened):
                    yield _accepted([first for first in opened if first is not None])
                    for early in held:
                        yield early
                    held.clear()
                continue
            event.index += prompt * requests[prompt].n
            if all(first is not None for first in opened):
                yield event
            else:
                held.append(event)


def _accepted(firsts: list[Event]) -> Event:
    accepted = inference_pb2.Accepted()
    accepted.CopyFrom(firsts[0].accepted)
    accepted.prompt_tokens = sum(first.accepted.prompt_tokens for first in firsts)
    return Event(accepted=accepted)

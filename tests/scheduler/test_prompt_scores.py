"""Prompt scores reach the gateway once per position, with the first token, whatever
preemption recomputed."""

from __future__ import annotations

from services.scheduler.prompt_scores import PromptScores
from services.scheduler.request import Request
from shared.outputs import RequestOutput
from shared.sampling import SamplingParams
from shared.step import PromptLogprobs, TokenLogprobs


def chunk(first: int, count: int) -> PromptLogprobs:
    entries = tuple(TokenLogprobs(p, -float(p), ()) for p in range(first, first + count))
    return PromptLogprobs("r", first, entries)


def test_recomputed_positions_are_kept_once_and_sent_with_the_first_token() -> None:
    request = Request("r", list(range(10)), SamplingParams(prompt_logprobs=0), 0)
    requests = {"r": request}
    scores = PromptScores()
    scores.add([chunk(1, 3)], requests)
    scores.add([chunk(1, 4)], requests)  # preempted: recomputed from the start, one further
    scores.add([chunk(5, 4)], requests)
    no_token = RequestOutput("r", ())
    scores.attach([no_token])
    assert no_token.prompt_logprobs == ()
    request.token_ids.append(42)
    first = RequestOutput("r", (42,))
    scores.attach([first])
    assert [e.token_id for e in first.prompt_logprobs] == list(range(1, 9))
    scores.add([chunk(1, 9)], requests)  # a recompute after the first token: already sent
    later = RequestOutput("r", (43,))
    scores.attach([later])
    assert later.prompt_logprobs == ()


def test_an_ended_request_leaves_nothing_behind() -> None:
    request = Request("r", list(range(10)), SamplingParams(prompt_logprobs=0), 0)
    scores = PromptScores()
    scores.add([chunk(1, 3)], {"r": request})
    scores.forget("r")
    output = RequestOutput("r", (1,))
    scores.attach([output])
    assert output.prompt_logprobs == ()

"""--stream-interval: the step loop sends a request's first token at once, then its tokens N at a
time, and whatever it still holds before any terminal event (finish, expiry, worker lost)."""

from __future__ import annotations

import pytest

from kvmesh.cli import build_parser as kvmesh_parser
from kvmesh.mesh.settings import service_args
from services.scheduler.config import build_parser, scheduler_config
from services.scheduler.request_trace import RequestTrace
from services.scheduler.step_loop import StepLoop
from services.scheduler.tracked import Tracked
from shared.config import SchedulerConfig
from shared.errors import KvmeshError
from shared.pb.kvmesh.v1 import scheduler_pb2
from shared.runtime.settings import SCHEDULER, SettingError
from shared.sampling import SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import make_scheduler, run_to_completion

PROMPT = list(range(1, 10))


async def _unused_readiness(ready: bool) -> None:
    pass


def loop_with(interval: int) -> StepLoop:
    config = SchedulerConfig(stream_interval=interval)
    loop = StepLoop(config, True, "127.0.0.1:1", _unused_readiness)
    loop.scheduler = make_scheduler()
    return loop


def admit(loop: StepLoop, request_id: str, max_tokens: int) -> Tracked:
    assert loop.scheduler is not None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    loop.scheduler.add_request(request_id, PROMPT, params)
    tracked = Tracked(request_id, RequestTrace(None, request_id, len(PROMPT), "", loop.tally))
    loop.tracked[request_id] = tracked
    return tracked


def step(loop: StepLoop, worker: FakeWorker) -> None:
    assert loop.scheduler is not None
    plan = loop.scheduler.schedule()
    loop._dispatch(loop.scheduler.update(plan, worker.execute(plan)))


def run_to_end(loop: StepLoop, tracked: Tracked) -> list[scheduler_pb2.SubmitEvent]:
    worker = FakeWorker(4)
    while tracked.request_id in loop.tracked:
        step(loop, worker)
    return sent(tracked)


def sent(tracked: Tracked) -> list[scheduler_pb2.SubmitEvent]:
    events = []
    while not tracked.events.empty():
        events.append(tracked.events.get_nowait())
    return events


def expected_tokens(max_tokens: int) -> list[int]:
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    scheduler.add_request("a", PROMPT, params)
    return run_to_completion(scheduler, FakeWorker(4))["a"]


async def test_the_first_token_at_once_then_every_interval_and_the_rest_at_the_finish() -> None:
    loop = loop_with(3)
    events = run_to_end(loop, admit(loop, "a", max_tokens=8))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["tokens"] * 4 + ["finished"]
    assert [len(e.tokens.token_ids) for e in events[:-1]] == [1, 3, 3, 1]
    assert events[0].tokens.HasField("first")
    assert [t for e in events[:-1] for t in e.tokens.token_ids] == expected_tokens(8)


async def test_held_tokens_go_out_before_a_deadline_failure() -> None:
    loop = loop_with(5)
    tracked = admit(loop, "a", max_tokens=20)
    worker = FakeWorker(4)
    while tracked.output_tokens < 4:
        step(loop, worker)
    assert [len(e.tokens.token_ids) for e in sent(tracked)] == [1]  # three held
    loop._expire("a")
    events = sent(tracked)
    assert [e.WhichOneof("event") for e in events] == ["tokens", "failed"]
    assert list(events[0].tokens.token_ids) == expected_tokens(20)[1:4]
    assert loop.scheduler is not None and "a" not in loop.scheduler.requests


async def test_an_interval_of_one_sends_every_step() -> None:
    loop = loop_with(1)
    events = run_to_end(loop, admit(loop, "a", max_tokens=5))
    assert [len(e.tokens.token_ids) for e in events[:-1]] == [1] * 5


def test_kvmesh_up_forwards_the_interval_to_its_schedulers() -> None:
    up = kvmesh_parser().parse_args(["up", "--stream-interval", "4"])
    forwarded = service_args(up, SCHEDULER)
    assert scheduler_config(build_parser().parse_args(forwarded)).stream_interval == 4
    with pytest.raises(SettingError, match="argument --stream-interval: 0 is below 1"):
        build_parser().parse_args(["--stream-interval", "0"])
    with pytest.raises(KvmeshError, match="stream_interval must be positive"):
        SchedulerConfig(stream_interval=0)

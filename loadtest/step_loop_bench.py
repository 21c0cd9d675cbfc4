"""The scheduler service's whole step loop at a steady batch, for `make bench-host`.

The `link` modes time the scheduler's own calls around the step protocol; a scheduler service
does more each step: it writes every request's tokens into its lane's reply and sends the reply
on. Here the real `SchedulerService` runs its `StepLoop` against the host-only worker (the same
child as the `link` modes), its requests open as lanes of one `LaneStream`, as a gateway's
are, and each reply is serialized as its gRPC write would (the gateway's end is not run).
Per step: the wall time, the process's CPU (step loop, lanes, the worker link's gRPC) and the
worker's own time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator

from loadtest.host_only_worker import WARM_STEPS, prefilled, steady_prompts
from services.scheduler.server import SchedulerService
from services.scheduler.submit_lanes import LaneStream
from services.scheduler.tracked import Counters
from shared.config import EngineConfig
from shared.pb.kvmesh.v1 import common_pb2, scheduler_pb2
from shared.runtime.service import ServiceRuntime

READY_TIMEOUT_S = 120


async def through_service(
    address: str, config: EngineConfig, batches: list[int], steps: int
) -> list[tuple[float, float, float]]:
    """Each batch's µs a step (wall, the process's CPU, the worker's compute), all on one
    event loop: a gRPC object of a closed loop would still be answered on the next one."""
    return [await _steady_service(address, config, batch, steps) for batch in batches]


async def _steady_service(
    address: str, config: EngineConfig, batch: int, steps: int
) -> tuple[float, float, float]:
    runtime = ServiceRuntime("kvmesh.v1.Scheduler", "127.0.0.1", 0)
    scheduler_config = dataclasses.replace(config.scheduler, plan_ahead="on")
    service = SchedulerService(runtime, scheduler_config, True, address, max_waiting=batch)
    stepping = asyncio.create_task(service.loop.run())
    started = time.monotonic()
    while not service.loop.worker_ready:
        if time.monotonic() - started > READY_TIMEOUT_S:  # the child worker refused or died
            stepping.cancel()
            raise RuntimeError(f"no worker ready at {address} in {READY_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.01)
    done = asyncio.Event()
    replies = _service_replies(service, _lanes(batch, service.loop.model), done)
    timed: dict[str, float] = {}
    decoding_from: int | None = None  # the step count once every lane was past its prefill
    async for reply in replies:
        reply.SerializeToString()  # what its write to the gateway would cost
        counters = service.loop.counters
        if decoding_from is None and _decoding(service, batch):
            decoding_from = counters.steps
        elif not timed and decoding_from is not None:
            if counters.steps - decoding_from >= WARM_STEPS:
                timed = _snapshot(counters)
        elif timed and counters.steps - timed["steps"] >= steps:
            break
    if not timed:
        raise RuntimeError(f"the lanes ended before batch {batch} decoded steadily")
    end = _snapshot(service.loop.counters)
    done.set()
    await replies.aclose()
    stepping.cancel()
    await asyncio.gather(stepping, return_exceptions=True)
    await service.loop.link.close()
    await runtime.server.stop(None)  # never started, but its completion queue is this loop's
    count = end["steps"] - timed["steps"]
    wall, cpu, worker = ((end[key] - timed[key]) / count * 1e6 for key in ("wall", "cpu", "worker"))
    return wall, cpu, worker


def _service_replies(
    service: SchedulerService, lanes: scheduler_pb2.SubmitLanesRequest, done: asyncio.Event
) -> AsyncGenerator[scheduler_pb2.SubmitLanesResponse, None]:
    async def requests() -> AsyncIterator[scheduler_pb2.SubmitLanesRequest]:
        yield lanes
        await done.wait()  # the caller's side stays open: a closed side ends no lane

    return LaneStream(service.events).replies(requests())


def _lanes(batch: int, model: common_pb2.ModelInfo | None) -> scheduler_pb2.SubmitLanesRequest:
    vocab = model.vocab_size if model else 1000
    sampling = common_pb2.SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    return scheduler_pb2.SubmitLanesRequest(
        lanes=[
            scheduler_pb2.SubmitLane(
                lane=index,
                submit=scheduler_pb2.SubmitRequest(
                    request_id=f"r{index}", token_ids=prompt, sampling=sampling
                ),
            )
            for index, prompt in enumerate(steady_prompts(batch, vocab))
        ]
    )


def _decoding(service: SchedulerService, batch: int) -> bool:
    """Every lane admitted (before they reach it, nothing waits either) and past its prompt."""
    scheduler = service.loop.scheduler
    return scheduler is not None and len(scheduler.running) == batch and prefilled(scheduler)


def _snapshot(counters: Counters) -> dict[str, float]:
    return {
        "steps": counters.steps,
        "wall": time.perf_counter(),
        "cpu": time.process_time(),
        "worker": counters.worker_compute_ms / 1e3,
    }

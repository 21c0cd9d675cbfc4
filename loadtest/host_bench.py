"""The host's share of a step: scheduler, batch building and the step protocol, with a model
that computes nothing, in steady decode.

Every request decodes for the whole run (ignore_eos, no max); the model is replaced by one that
builds the step's batch as the default CPU path does and then "samples" a fixed token per
request without computing anything. What is left is the Python every step pays in series with
the forward pass (the worker: host_only_worker.py). Four ways:

- in process: `Scheduler.schedule()` -> `Worker.execute()` -> `Scheduler.update()`, as the
  in-process Engine runs them; scheduler and worker µs apart;
- over the link, lock-step: the same scheduler in this process, the worker in a child process
  behind the real engine-worker gRPC server on loopback, in the step loop's order of things
  (StepPipeline): each plan encoded, sent, decoded, and the result back;
- over the link, ahead: the same, the next plan sent while the worker runs the current one;
- the service, ahead: the scheduler service's whole step loop, tokens into its lanes' replies
  too (step_loop_bench.py); its "scheduler µs" is the process's CPU a step.

"added" is a step's wall time less the worker's own: what the host adds to every step.

    python -m loadtest.host_bench [--batches 1,32,128,256] [--steps 200]
        [--modes inprocess,link,service]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.mesh.service_process import free_port
from loadtest.host_only_worker import (
    WARM_STEPS,
    engine_config,
    host_only_worker,
    prefilled,
    serve_worker,
    steady_prompts,
)
from loadtest.step_loop_bench import through_service
from services.engine_worker.worker import Worker
from services.scheduler.scheduler import Scheduler
from shared.config import EngineConfig
from shared.sampling import SamplingParams


def fill(scheduler: Scheduler, batch: int, vocab: int) -> None:
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(steady_prompts(batch, vocab)):
        scheduler.add_request(f"r{index}", prompt, params)


def new_scheduler(worker_info: tuple[int, int, tuple[int, ...]], config: EngineConfig) -> Scheduler:
    num_blocks, max_model_len, eos = worker_info
    return Scheduler(config.scheduler, config.cache, num_blocks, max_model_len, eos)


@dataclass
class Row:
    mode: str
    batch: int
    step_us: float
    scheduler_us: float
    worker_us: float
    preempted: int = 0  # in the timed steps: above 0, the batch was not steady

    @property
    def idle_us(self) -> float:
        """Per step, the time the worker is not computing: what the host adds to the step."""
        return self.step_us - self.worker_us


def _steady(run_step: Callable[[], tuple[float, float]], steps: int) -> tuple[float, float, float]:
    """Mean (wall, scheduler, worker) µs of `steps` steps after the warm ones."""
    for _ in range(WARM_STEPS):
        run_step()
    wall = scheduler = worker = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        scheduler_s, worker_s = run_step()
        wall += time.perf_counter() - started
        scheduler += scheduler_s
        worker += worker_s
    return wall / steps * 1e6, scheduler / steps * 1e6, worker / steps * 1e6


def in_process(worker: Worker, config: EngineConfig, batch: int, steps: int) -> Row:
    scheduler = new_scheduler(_info(worker), config)
    fill(scheduler, batch, worker.architecture.vocab_size)

    def run_step() -> tuple[float, float]:
        started = time.perf_counter()
        plan = scheduler.schedule()
        planned = time.perf_counter()
        result = worker.execute(plan)
        executed = time.perf_counter()
        scheduler.update(plan, result)
        return planned - started + time.perf_counter() - executed, executed - planned

    while not prefilled(scheduler):
        run_step()
    before = scheduler.num_preemptions
    row = Row("in process", batch, *_steady(run_step, steps))
    row.preempted = scheduler.num_preemptions - before
    for request_id in list(scheduler.requests):
        scheduler.abort(request_id)
    worker.execute(scheduler.schedule())  # the worker forgets them
    return row


def _info(worker: Worker) -> tuple[int, int, tuple[int, ...]]:
    return worker.num_kv_blocks, worker.max_model_len, worker.architecture.eos_token_ids


async def over_link(address: str, config: EngineConfig, batch: int, steps: int, ahead: bool) -> Row:
    """The step loop's order of things (StepPipeline), lock-step or one step ahead."""
    from services.scheduler.step_pipeline import StepPipeline
    from services.scheduler.worker_link import WorkerLink
    from shared.codec import plan_to_pb

    link = WorkerLink(address, lambda: None)
    model = await link.connect()
    info = (model.kv_blocks, model.max_model_len, tuple(model.eos_token_ids))
    scheduler = new_scheduler(info, config)
    fill(scheduler, batch, model.vocab_size)
    spent = {"scheduler": 0.0, "worker": 0.0}

    def timed(function: Callable) -> Callable:
        def run(*args: object) -> object:
            started = time.perf_counter()
            value = function(*args)
            spent["scheduler"] += time.perf_counter() - started
            return value

        return run

    scheduler.schedule = timed(scheduler.schedule)  # type: ignore[method-assign]
    scheduler.update = timed(scheduler.update)  # type: ignore[method-assign]
    scheduler.assume = timed(scheduler.assume)  # type: ignore[method-assign]

    def settled(outputs: object, result: Any, plan: object) -> None:
        spent["worker"] += result.compute_ms / 1e3

    pipeline = StepPipeline(link, scheduler, ahead, settled)

    async def run_step() -> None:
        plan = scheduler.schedule()
        await pipeline.send(plan, plan_to_pb(plan))
        await pipeline.after_send()

    while not prefilled(scheduler):
        await run_step()
    for _ in range(WARM_STEPS):
        await run_step()
    spent.update(scheduler=0.0, worker=0.0)
    preempted = scheduler.num_preemptions
    started = time.perf_counter()
    for _ in range(steps):
        await run_step()
    wall = time.perf_counter() - started
    while pipeline.sent:
        await pipeline.settle_oldest()
    await link.close()
    mode = "link, ahead" if ahead else "link, lock-step"
    row = Row(mode, batch, *(seconds / steps * 1e6 for seconds in (wall, *spent.values())))
    row.preempted = scheduler.num_preemptions - preempted
    return row


def print_table(rows: list[Row]) -> None:
    print(
        f"{'mode':<16} {'batch':>5} {'step µs':>8} {'scheduler µs':>12} {'worker µs':>9} "
        f"{'added µs':>8} {'added µs/request':>16} {'preempted':>9}"
    )
    for row in rows:
        print(
            f"{row.mode:<16} {row.batch:>5} {row.step_us:>8.0f} {row.scheduler_us:>12.0f} "
            f"{row.worker_us:>9.0f} {row.idle_us:>8.0f} {row.idle_us / row.batch:>16.2f} "
            f"{row.preempted:>9}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="inprocess,link,service")
    parser.add_argument("--serve-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.serve_worker:
        serve_worker(args.serve_worker, max(batches), args.steps)
        return
    config = engine_config(max(batches), args.steps)
    modes = args.modes.split(",")
    rows: list[Row] = []
    if "inprocess" in modes:
        worker = host_only_worker(config)
        rows += [in_process(worker, config, batch, args.steps) for batch in batches]
    if "link" in modes or "service" in modes:
        port = free_port()
        address = f"127.0.0.1:{port}"
        command = [sys.executable, "-m", "loadtest.host_bench", "--serve-worker", str(port)]
        child = subprocess.Popen([*command, "--batches", args.batches, "--steps", str(args.steps)])
        try:
            for ahead in (False, True) if "link" in modes else ():
                for batch in batches:
                    rows.append(asyncio.run(over_link(address, config, batch, args.steps, ahead)))
            if "service" in modes:
                timed = asyncio.run(through_service(address, config, batches, args.steps))
                rows += [Row("service, ahead", b, *t) for b, t in zip(batches, timed, strict=True)]
        finally:
            child.terminate()
            child.wait(30)
    print_table(rows)


if __name__ == "__main__":
    main()

"""The host's share of a step: scheduler, batch building and the step protocol, with a model
that computes nothing, in steady decode.

Every request decodes for the whole run (ignore_eos, no max); the model is replaced by one that
builds the step's batch as the default CPU path does and then "samples" a fixed token per
request without computing anything. What is left is the Python every step pays in series with
the forward pass. Three ways:

- in process: `Scheduler.schedule()` -> `Worker.execute()` -> `Scheduler.update()`, as the
  in-process Engine runs them; scheduler and worker µs apart;
- over the link, lock-step: the same scheduler in this process, the worker in a child process
  behind the real engine-worker gRPC server on loopback, in the step loop's order of things
  (StepPipeline): each plan encoded, sent, decoded, and the result back;
- over the link, ahead: the same, the next plan sent while the worker runs the current one.

"added" is a step's wall time less the worker's own: what the host adds to every step.

    python -m loadtest.host_bench [--batches 1,32,128,256] [--steps 200] [--modes inprocess,link]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.mesh.service_process import free_port
from services.engine_worker.step_inputs import RequestState, flatten, unique_states
from services.engine_worker.torch_backend.graph_batch import GraphBatch
from services.engine_worker.worker import Worker
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.runtime.heap import freeze_startup_heap
from shared.sampling import SamplingParams
from shared.step import SampledToken

PROMPT_TOKENS = 32
WARM_STEPS = 8  # after the prefills: the first decode steps grow every list once
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # the default model's: layers, K and V, heads, dims, f32
BLOCK_SLACK_TOKENS = 32  # each request's last block, partly filled, and one more step ahead


class HostOnlyRunner:
    """The worker's runner with the model taken out: the batch is built (flatten and the
    compiled step's tensors, the default CPU path) and each request samples a fixed token."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.block_size = runner.kv_cache.shape.block_size

    @property
    def kv_pool(self):
        return self.runner.kv_pool

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        self.runner.copy_blocks(pairs)

    def take_prompt_scores(self) -> tuple[()]:  # no request asks for prompt logprobs here
        return ()

    def step(
        self, scheduled: list[tuple[RequestState, int]], rng: torch.Generator
    ) -> tuple[tuple[RequestState, ...], list[SampledToken]]:
        tables = self.runner.block_tables
        flat = flatten(scheduled, self.block_size, None if tables is None else tables.table)
        GraphBatch.of(flat)
        states = unique_states(flat.sampling_states)
        return states, [SampledToken(s.request_id, 100 + len(s.token_ids) % 1000) for s in states]


def engine_config(max_batch: int, steps: int) -> EngineConfig:
    """Room for `max_batch` requests of PROMPT_TOKENS plus every decode step of the run: a
    pool that ran out would preempt, and the figures would not be of a steady batch."""
    scheduler = SchedulerConfig(max_num_batched_tokens=max(2048, max_batch), max_num_seqs=max_batch)
    tokens = PROMPT_TOKENS + 2 * WARM_STEPS + steps + BLOCK_SLACK_TOKENS
    room = max_batch * tokens * KV_BYTES_PER_TOKEN
    return EngineConfig(
        weights="float32",
        compile="off",
        prepared="off",
        num_threads=1,
        cache=CacheConfig(kv_memory_bytes=int(os.environ.get("KVMESH_HOST_BENCH_KV", room))),
        scheduler=scheduler,
    )


def host_only_worker(config: EngineConfig) -> Worker:
    worker = Worker(config)
    worker.runner = HostOnlyRunner(worker.runner)
    freeze_startup_heap()  # as the worker service and the Engine do once ready
    return worker


def fill(scheduler: Scheduler, batch: int, vocab: int) -> None:
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)]
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


def _prefilled(scheduler: Scheduler) -> bool:
    return not scheduler.waiting and all(
        r.num_computed_tokens >= r.prompt_len for r in scheduler.running
    )


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

    while not _prefilled(scheduler):
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

    while not _prefilled(scheduler):
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


def serve_worker(port: int, max_batch: int, steps: int) -> None:
    """The child: the real engine-worker server, its model replaced by the host-only one."""
    from services.engine_worker.server import EngineWorkerService
    from shared.pb.kvmesh.v1 import engine_worker_pb2_grpc
    from shared.runtime.service import ServiceRuntime

    async def serve() -> None:
        runtime = ServiceRuntime("kvmesh.v1.EngineWorker", "127.0.0.1", port)
        service = EngineWorkerService(runtime, engine_config(max_batch, steps))
        runtime.add_servicer(engine_worker_pb2_grpc.add_EngineWorkerServicer_to_server, service)
        await runtime.start()
        service.worker = host_only_worker(service.config)
        await runtime.set_ready(True)
        await runtime.serve_until_signalled(0)

    asyncio.run(serve())


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
    parser.add_argument("--modes", default="inprocess,link")
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
    if "link" in modes:
        port = free_port()
        command = [sys.executable, "-m", "loadtest.host_bench", "--serve-worker", str(port)]
        child = subprocess.Popen([*command, "--batches", args.batches, "--steps", str(args.steps)])
        try:
            for ahead in (False, True):
                for batch in batches:
                    link = over_link(f"127.0.0.1:{port}", config, batch, args.steps, ahead)
                    rows.append(asyncio.run(link))
        finally:
            child.terminate()
            child.wait(30)
    print_table(rows)


if __name__ == "__main__":
    main()

"""The worker `make bench-host` runs against: the real one with its model taken out.

Its runner builds each step's batch as the default CPU path does (flatten and the compiled
step's tensors), then "samples" a fixed token per request without computing anything, so a
step costs the host's work alone. In process it is a `Worker`; over the link it is served by
the real engine-worker gRPC server in a child process (`serve_worker`).
"""

from __future__ import annotations

import asyncio
import os
import random

import torch

from services.engine_worker.step_inputs import RequestState, flatten, unique_states
from services.engine_worker.torch_backend.graph_batch import GraphBatch
from services.engine_worker.worker import Worker
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.runtime.heap import freeze_startup_heap
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
    freeze_startup_heap()  # as a service does once ready
    return worker


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


def steady_prompts(batch: int, vocab: int) -> list[list[int]]:
    """The bench's prompts for a batch: PROMPT_TOKENS random ids each, the same every run."""
    rng = random.Random(batch)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def prefilled(scheduler: Scheduler) -> bool:
    """Nothing waits and every running request is past its prompt: steady decode."""
    return not scheduler.waiting and all(
        r.num_computed_tokens >= r.prompt_len for r in scheduler.running
    )

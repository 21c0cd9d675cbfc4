"""The engine-worker's gRPC face: one step stream from one scheduler, info, warm-up.

The model loads in a thread after the server starts, so liveness answers at once and
readiness turns SERVING only once the model is validated, loaded and warmed. Steps run in a
thread too: health checks stay answered while a long prefill computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
from prometheus_client import Counter, Histogram

from services.engine_worker.compiled_step_status import finish_preparation, report_preparation
from services.engine_worker.kv_tiers.handover import LeaseEnded
from services.engine_worker.step_failures import CircuitBreaker, FaultInjector
from services.engine_worker.step_telemetry import record_step
from services.engine_worker.worker import Worker
from shared.codec import (
    default_sampling_to_pb,
    plan_from_pb,
    response_format_from_pb,
    result_to_pb,
)
from shared.config import EngineConfig
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, engine_worker_pb2, engine_worker_pb2_grpc
from shared.runtime.metrics import TOKEN_SECONDS
from shared.runtime.service import ServiceRuntime

log = logging.getLogger("kvmesh.engine_worker")
T = TypeVar("T")
STEP_FAILURES = Counter(
    "kvmesh_step_failed_requests",
    "Requests a step could not compute (each failed alone)",
    ["reason"],
)
SCHEMA_COMPILE_SECONDS = Histogram(
    "kvmesh_schema_compile_seconds",
    "Compiling a response format's grammar (once per distinct format)",
    buckets=TOKEN_SECONDS,
)


def model_info(worker: Worker, served_name: str | None = None) -> common_pb2.ModelInfo:
    manifest = worker.manifest
    return common_pb2.ModelInfo(
        name=served_name or manifest.model_name,
        version=manifest.version,
        artifact_digest=manifest.artifact_digest,
        artifact_sha256=manifest.artifact_sha256,
        artifact_path=manifest.artifact_path,
        architecture=manifest.architecture,
        num_parameters=manifest.num_parameters,
        dtype=manifest.dtype,
        quantization=manifest.quantization,
        backend=manifest.backend,
        max_model_len=manifest.max_model_len,
        kv_block_size=manifest.kv_block_size,
        kv_blocks=manifest.kv_blocks,
        kv_cache_bytes=manifest.kv_cache_bytes,
        kv_bytes_per_token=manifest.kv_bytes_per_token,
        load_seconds=manifest.load_seconds,
        warmup_seconds=manifest.warmup_seconds,
        vocab_size=worker.architecture.vocab_size,
        eos_token_ids=worker.architecture.eos_token_ids,
        aliases=manifest.aliases,
        default_sampling=default_sampling_to_pb(manifest.default_sampling or {}),
        task="generate",
        runtime=manifest.runtime or {},
        device=manifest.device,
        threads=manifest.threads,
        tokenizer_digest=manifest.tokenizer_digest,
        cuda_graphs=manifest.cuda_graphs or {},
        prepared_id=manifest.prepared_id,
        max_step_tokens=manifest.max_step_tokens,
        max_step_sampled_rows=manifest.max_step_sampled_rows,
        sliding_window=manifest.sliding_window,
        kv_window_blocks=manifest.kv_window_blocks,
    )


class EngineWorkerService(engine_worker_pb2_grpc.EngineWorkerServicer):
    def __init__(
        self,
        runtime: ServiceRuntime,
        config: EngineConfig,
        served_name: str | None = None,
        breaker: CircuitBreaker | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.served_name = served_name  # the name clients use, when not the artifact's own
        self.breaker = breaker or CircuitBreaker()
        self.faults = faults
        self.worker: Worker | None = None
        self._driven = False  # one scheduler at a time owns the KV pool
        # Every torch call from one OS thread: OpenMP keeps a thread team per calling thread, and
        # a pool of several callers would leave teams spinning against each other on few cores.
        self._torch_thread = concurrent.futures.ThreadPoolExecutor(1, "torch")
        self._preparing: asyncio.Task[None] | None = None  # the compiled step, compiling

    async def _in_torch_thread(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._torch_thread, function, *args)

    async def load(self) -> None:
        try:
            self.worker = await self._in_torch_thread(Worker, self.config, True)
            self.worker.faults = self.faults
        except KvmeshError as error:
            log.error("model refused", extra={"reason": error.reason.value, "error": error.message})
            raise
        except Exception:
            log.exception("model failed to load")
            raise
        await report_preparation(self.worker, self.runtime)
        log.info("ready", extra={"manifest": self.worker.manifest.to_dict()})
        await self.runtime.set_ready(True)
        if self.worker.pending_preparation is not None:
            self._preparing = asyncio.create_task(
                finish_preparation(self.worker, self.runtime, self._in_torch_thread)
            )

    def _ready_worker(self) -> Worker:
        if self.worker is None:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                "the model is still loading",
                retryable=True,
                retry_after_ms=1000,
            )
        return self.worker

    async def Step(
        self,
        request_iterator: AsyncIterator[engine_worker_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_worker_pb2.StepResult]:
        worker = self._ready_worker()
        if self._driven:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, "another scheduler already drives this worker"
            )
        self._driven = True
        log.info("scheduler attached", extra={"peer": context.peer()})
        # Counted as in flight: a SIGTERM drain waits until the scheduler, seeing this worker
        # NOT_SERVING, has finished its requests and let go of the stream.
        with self.runtime.in_flight():
            try:
                async for message in request_iterator:
                    plan = plan_from_pb(message)
                    started, started_ns = time.perf_counter(), time.time_ns()
                    result = await self._in_torch_thread(worker.execute, plan)
                    seconds = time.perf_counter() - started
                    worker.kv_transfer.observe_step(plan.num_prefill_tokens, seconds)
                    loads = worker.kv_transfer.step_loads
                    record_step(message, seconds, started_ns, self.runtime.address, loads)
                    yield result_to_pb(result, seconds * 1e3)
                    for failure in result.failed:
                        STEP_FAILURES.labels(failure.reason).inc()
                    if self.breaker.record(result.failed, len(result.sampled)):
                        await self._open_breaker()
            finally:
                # Queued behind a step still running in the torch thread, never beside it.
                self._torch_thread.submit(worker.requests.clear)  # the next scheduler: empty
                self._driven = False
                log.info("scheduler detached")

    async def _open_breaker(self) -> None:
        log.error(
            "circuit breaker open: too many failed requests; not ready",
            extra={
                "failures": self.breaker.max_failures,
                "window_s": self.breaker.window_s,
                "cooldown_s": self.breaker.cooldown_s,
            },
        )
        await self.runtime.set_ready(False)  # the scheduler drains us, the gateway moves on
        asyncio.get_running_loop().call_later(
            self.breaker.cooldown_s, lambda: asyncio.ensure_future(self._close_breaker())
        )

    async def _close_breaker(self) -> None:
        log.info("circuit breaker closed: ready again")
        await self.runtime.set_ready(True)

    async def GetInfo(
        self, request: engine_worker_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_worker_pb2.WorkerInfo:
        worker = self._ready_worker()
        tiers = worker.config.kv_tiers
        return engine_worker_pb2.WorkerInfo(
            model=model_info(worker, self.served_name),
            kv_tiers=engine_worker_pb2.KVTierInfo(
                tiers=tiers.tiers, write=tiers.write, load_min_tokens=tiers.load_min_tokens
            ),
        )

    async def LookupBlocks(
        self, request: engine_worker_pb2.BlockLookup, context: grpc.aio.ServicerContext
    ) -> engine_worker_pb2.BlockLookupResult:
        # Off the step thread and the event loop: the disk index and Redis answer here.
        leading = self._ready_worker().kv_transfer.leading
        found = await asyncio.to_thread(leading, list(request.block_hashes))
        return engine_worker_pb2.BlockLookupResult(num_leading=found)

    async def PullBlocks(
        self, request: engine_worker_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> engine_worker_pb2.PullResult:
        return await self._ready_worker().kv_transfer.inbox.pull(request)

    async def ExportBlocks(
        self, request: engine_worker_pb2.ExportRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_worker_pb2.BlockRecord]:
        """A leased request's blocks, each read and packed off the event loop."""
        records = self._ready_worker().handover_exports.records(
            request.lease_id, request.num_blocks
        )
        while True:
            try:
                record = await asyncio.to_thread(next, records, None)
            except LeaseEnded:
                await context.abort(grpc.StatusCode.NOT_FOUND, "no lease holds these blocks")
            if record is None:
                return
            yield engine_worker_pb2.BlockRecord(record=record)

    async def PrepareFormat(
        self, request: common_pb2.ResponseFormat, context: grpc.aio.ServicerContext
    ) -> engine_worker_pb2.PrepareFormatResponse:
        worker = self._ready_worker()
        response_format = response_format_from_pb(request)
        grammars = await asyncio.to_thread(worker.grammars)
        if grammars.compiled(response_format):
            return engine_worker_pb2.PrepareFormatResponse()
        started = time.perf_counter()
        # Its own thread: the torch thread keeps stepping the batch meanwhile.
        await asyncio.to_thread(grammars.matcher, response_format)
        seconds = time.perf_counter() - started
        SCHEMA_COMPILE_SECONDS.observe(seconds)
        return engine_worker_pb2.PrepareFormatResponse(compile_seconds=seconds)

    async def Warmup(
        self, request: engine_worker_pb2.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> engine_worker_pb2.WarmupResponse:
        worker = self._ready_worker()
        if self._driven:
            # Warm-up writes scratch blocks; while a scheduler runs steps they may hold its KV.
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, "warm-up needs an idle worker (no scheduler)"
            )
        started = time.perf_counter()
        await self._in_torch_thread(worker.warm_up)
        return engine_worker_pb2.WarmupResponse(seconds=time.perf_counter() - started)

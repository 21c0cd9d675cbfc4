"""`python -m services.engine_worker`: load, validate and warm the model, then serve steps."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from services.engine_worker.config import build_parser, engine_config
from services.engine_worker.embed.server import EmbedderService
from services.engine_worker.preparation_underway import abandon_all
from services.engine_worker.server import EngineWorkerService
from services.engine_worker.step_failures import CircuitBreaker, FaultInjector
from shared.model_entry import artifact_location
from shared.model_paths import is_encoder, resolve_model_path
from shared.pb.kvmesh.v1 import engine_worker_pb2_grpc
from shared.runtime.logs import configure_logging
from shared.runtime.service import ServiceRuntime, start_observability
from shared.runtime.settings import parse_args_or_exit

SERVICE_NAME = "kvmesh.v1.EngineWorker"
EMBEDDER_SERVICE_NAME = "kvmesh.v1.Embedder"


async def serve(args: argparse.Namespace) -> None:
    model_path = resolve_model_path(args.model)
    service: EngineWorkerService | EmbedderService
    if is_encoder(artifact_location(model_path)):  # an embedding model: Embedder, no steps
        runtime = ServiceRuntime(EMBEDDER_SERVICE_NAME, args.host, args.port)
        service = EmbedderService(
            runtime, model_path, args.served_model_name, args.max_embed_batch_tokens
        )
        runtime.add_servicer(engine_worker_pb2_grpc.add_EmbedderServicer_to_server, service)
    else:
        runtime = ServiceRuntime(SERVICE_NAME, args.host, args.port)
        breaker = CircuitBreaker(
            args.breaker_failures, args.breaker_window_seconds, args.breaker_cooldown_seconds
        )
        service = EngineWorkerService(
            runtime,
            engine_config(args),
            args.served_model_name,
            breaker,
            FaultInjector.parse(args.inject_fault_token),
        )
        runtime.add_servicer(engine_worker_pb2_grpc.add_EngineWorkerServicer_to_server, service)
    await runtime.start()
    loading = asyncio.create_task(service.load())

    def stop_if_refused(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            runtime.stop()  # a model that cannot load: exit rather than stay unready forever

    loading.add_done_callback(stop_if_refused)
    await runtime.serve_until_signalled(args.drain_seconds)
    # Stopped while preparing (before ready, or serving while a child prepares): the child or
    # the compilers stop now rather than finish minutes later.
    abandoned = abandon_all()
    if not loading.done():  # the torch thread is busy loading: not waited for
        logging.getLogger("kvmesh").warning(
            "stopped while loading the model", extra={"preparations_abandoned": abandoned}
        )
        logging.shutdown()
        os._exit(0)
    if loading.done() and not loading.cancelled() and loading.exception() is not None:
        raise SystemExit(2)


def main() -> None:
    args = parse_args_or_exit(build_parser())
    configure_logging("engine-worker", args.log_level)
    start_observability("engine-worker", args)
    logging.getLogger("kvmesh").info("starting", extra={"model": args.model})
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

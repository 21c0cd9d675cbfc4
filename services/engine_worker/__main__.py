"""`python -m services.engine_worker`: load, validate and warm the model, then serve steps."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from services.engine_worker.embed.server import EmbedderService
from services.engine_worker.preparation_underway import abandon_all
from services.engine_worker.server import EngineWorkerService
from services.engine_worker.step_failures import BreakerDefaults, CircuitBreaker, FaultInjector
from shared.flag_env import env_default, env_float, env_int
from shared.flags import add_worker_flags, engine_config
from shared.logs import configure_logging
from shared.model_entry import artifact_location
from shared.model_paths import is_encoder, resolve_model_path
from shared.pb.kvmesh.v1 import engine_worker_pb2_grpc
from shared.service import ServiceRuntime, add_common_flags, start_observability

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


def add_failure_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("failures")
    group.add_argument(
        "--breaker-failures",
        type=int,
        default=env_int("breaker-failures", BreakerDefaults.max_failures),
        help="failed requests within --breaker-window-seconds that turn this worker not ready "
        "(its scheduler drains it, traffic moves); 0: never",
    )
    group.add_argument(
        "--breaker-window-seconds",
        type=float,
        default=env_float("breaker-window-seconds", BreakerDefaults.window_s),
    )
    group.add_argument(
        "--breaker-cooldown-seconds",
        type=float,
        default=env_float("breaker-cooldown-seconds", BreakerDefaults.cooldown_s),
        help="how long a tripped worker stays not ready before it serves again",
    )
    group.add_argument(
        "--inject-fault-token",
        default=env_default("inject-fault-token", None),
        help="tests only: TOKEN_ID[:AFTER][:worker],... fails every request whose prompt holds "
        "TOKEN_ID once it has AFTER output tokens (default 1); with :worker, every request from "
        "then on",
    )


def build_parser() -> argparse.ArgumentParser:
    """Every flag of this service (the configuration reference is generated from it)."""
    parser = argparse.ArgumentParser(prog="services.engine_worker", description=__doc__)
    add_common_flags(parser, default_port=50061)
    add_worker_flags(parser)
    parser.add_argument(
        "--served-model-name",
        default=env_default("served-model-name", None),
        help="the name clients use for the model (default: the repository entry's, else the "
        "artifact's file or folder name)",
    )
    parser.add_argument(
        "--max-embed-batch-tokens",
        type=int,
        default=env_int("max-embed-batch-tokens", 16384),
        help="embedding models: padded tokens (inputs x longest) per forward pass; 1: one "
        "input at a time",
    )
    add_failure_flags(parser)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    configure_logging("engine-worker", args.log_level)
    start_observability("engine-worker", args)
    logging.getLogger("kvmesh").info("starting", extra={"model": args.model})
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

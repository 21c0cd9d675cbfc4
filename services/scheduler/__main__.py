"""`python -m services.scheduler`: queue and batch requests for one engine-worker."""

from __future__ import annotations

import argparse
import asyncio
import logging

from prometheus_client import REGISTRY

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.redis_publisher import RedisPublisher
from services.scheduler.server import SchedulerService
from shared.flag_env import env_default, env_int
from shared.flags import add_scheduler_flags, scheduler_config
from shared.handover_flags import add_handover_flags, handover_config
from shared.logs import configure_logging
from shared.pb.kvmesh.v1 import scheduler_pb2_grpc
from shared.service import ServiceRuntime, add_common_flags, start_observability

SERVICE_NAME = "kvmesh.v1.Scheduler"
log = logging.getLogger("kvmesh.scheduler")


async def serve(args: argparse.Namespace) -> None:
    runtime = ServiceRuntime(SERVICE_NAME, args.host, args.port)
    service = SchedulerService(
        runtime,
        scheduler_config(args),
        enable_prefix_caching=not args.no_prefix_caching,
        worker_address=args.worker,
        max_waiting=args.max_waiting,
        handover=handover_config(args, args.worker),
    )
    runtime.add_servicer(scheduler_pb2_grpc.add_SchedulerServicer_to_server, service)
    REGISTRY.register(SchedulerMetrics(asyncio.get_running_loop(), service.reporter.report))
    await runtime.start()
    stepping = asyncio.create_task(service.loop.run())
    refused: list[BaseException] = []

    def stop_if_refused(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            refused.append(task.exception())  # type: ignore[arg-type]
            runtime.stop()  # e.g. step limits its worker cannot hold: exit, do not sit unready

    stepping.add_done_callback(stop_if_refused)
    tasks = [stepping]
    if args.redis:
        publisher = RedisPublisher(args.redis, args.advertise or runtime.address, service.reporter)
        tasks.append(asyncio.create_task(publisher.run()))
    await runtime.serve_until_signalled(args.drain_seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # the refusal is in `refused`
    if refused:
        log.error("scheduler stopped: %s", refused[0])
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of this service (the configuration reference is generated from it)."""
    parser = argparse.ArgumentParser(prog="services.scheduler", description=__doc__)
    add_common_flags(parser, default_port=50071)
    parser.add_argument(
        "--worker",
        default=env_default("worker", "127.0.0.1:50061"),
        help="engine-worker address",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=env_int("max-waiting", 1024),
        help="queued requests beyond this are refused with OVERLOADED",
    )
    parser.add_argument(
        "--redis",
        default=env_default("redis", None),
        help="publish load and prefix-cache contents here, e.g. redis://host:6379/0",
    )
    parser.add_argument(
        "--advertise",
        default=env_default("advertise", None),
        help="the address gateways know this scheduler by, which names its Redis entries "
        "(default: --host:--port)",
    )
    add_scheduler_flags(parser)
    add_handover_flags(parser)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    configure_logging("scheduler", args.log_level)
    start_observability("scheduler", args)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

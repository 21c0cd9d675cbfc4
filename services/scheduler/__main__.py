"""`python -m services.scheduler`: queue and batch requests for one engine-worker."""

from __future__ import annotations

import argparse
import asyncio
import logging

from prometheus_client import REGISTRY

from services.scheduler.config import build_parser, handover_config, scheduler_config
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.redis_publisher import RedisPublisher
from services.scheduler.server import SchedulerService
from shared.pb.kvmesh.v1 import scheduler_pb2_grpc
from shared.runtime.logs import configure_logging
from shared.runtime.service import ServiceRuntime, start_observability
from shared.runtime.settings import parse_args_or_exit

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


def main() -> None:
    args = parse_args_or_exit(build_parser())
    configure_logging("scheduler", args.log_level)
    start_observability("scheduler", args)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

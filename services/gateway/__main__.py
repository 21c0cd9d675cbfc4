"""`python -m services.gateway`: the public kvmesh.v1.Inference API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.gateway import processes
from services.gateway.config import SHARING_PORTS, build_parser
from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.mesh.model_admin import ModelAdminService
from services.gateway.mesh.peers import PeerGateways
from services.gateway.mesh.registry import BackendRegistry
from services.gateway.mesh.router import Router
from services.gateway.mesh.tokenizer_link import TokenizerLink
from services.gateway.mesh.watermarks import Watermarks
from services.gateway.openai_front.server import OpenAIFront
from services.gateway.policy.engine_failures import TenantFailures
from services.gateway.policy.limits import RequestLimits
from services.gateway.policy.policy import GatewayPolicy
from services.gateway.policy.rate_limits import RateLimiter
from services.gateway.policy.request_ids import RequestIds
from services.gateway.server import InferenceService
from shared.pb.kvmesh.v1 import inference_pb2_grpc, model_admin_pb2_grpc
from shared.redis_link import RedisLink
from shared.runtime.logs import configure_logging
from shared.runtime.service import ServiceRuntime, start_observability
from shared.runtime.settings import parse_args_or_exit
from shared.tenants import ApiKeys

SERVICE_NAME = "kvmesh.v1.Inference"
log = logging.getLogger("kvmesh.gateway")
DEGRADED = (
    "routing by this gateway's own in-flight counts, admission by each scheduler's bounded "
    "queue, tenant limits by per-gateway local buckets"
)


def gateway_policy(args: argparse.Namespace, link: RedisLink | None) -> GatewayPolicy:
    keys = ApiKeys.configured(args.api_keys_file)
    keys.default_max_concurrent(args.max_streams_per_tenant)
    if keys.enabled:
        names = ", ".join(sorted(t.name for t in keys.tenants))
        log.info("auth on: requests need an API key", extra={"tenants": names})
    else:
        log.warning(
            "auth off: no API keys configured (--api-keys-file or KVMESH_API_KEYS); "
            "every request runs as tenant 'anonymous'"
        )
    watermarks = Watermarks(args.max_queue_ms, args.max_queue_tokens)
    return GatewayPolicy(
        api_keys=keys,
        router=Router(link, args.routing, watermarks),
        rate_limiter=RateLimiter(link),
        request_ids=RequestIds(link),
        max_in_flight=args.max_in_flight,
        limits=RequestLimits(args.max_request_bytes, args.max_prompt_tokens, args.max_total_tokens),
        tenant_failures=TenantFailures(args.tenant_failures_per_minute),
        stall_timeout_s=args.stall_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_http_per_client=args.max_http_requests_per_client,
        trace_content=args.trace_content,
        handover_min_tokens=args.handover_min_tokens,
    )


async def serve(args: argparse.Namespace) -> None:
    runtime = ServiceRuntime(SERVICE_NAME, args.host, args.port, public=True)
    schedulers = [spec for spec in args.scheduler.split(",") if spec]
    embedders = [spec for spec in args.embedder.split(",") if spec]
    tokenizer = TokenizerLink(args.tokenizer)
    registry = BackendRegistry(tokenizer, schedulers, embedders)
    catalog = ModelCatalog(registry, args.default_model)
    link = RedisLink(args.redis, degraded=DEGRADED) if args.redis else None
    if link is None:
        log.warning("no --redis: routing and admission use this gateway's local view only")
    policy = gateway_policy(args, link)
    peers = PeerGateways(args.peers, runtime.address) if args.peers else None
    service = InferenceService(runtime, catalog, tokenizer, policy, peers)
    generate = service.generate  # one handler for gRPC and HTTP: one admission, one in-flight
    runtime.add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server, service)
    runtime.add_servicer(
        model_admin_pb2_grpc.add_ModelAdminServicer_to_server,
        ModelAdminService(catalog, policy.api_keys),
    )
    await runtime.start()
    front = OpenAIFront(generate, catalog)
    if args.http_port and not args.shared_port:
        await front.start(args.host, args.http_port)
    registry.start(runtime.set_ready)
    if args.shared_port:  # the ports it shares with the host's other gateways, once ready
        await runtime.ready_once.wait()
        await runtime.serve_shared_port(f"{args.host}:{args.shared_port}")
        if args.http_port:
            await front.start(args.host, args.http_port, reuse_port=True)
        log.info(SHARING_PORTS, extra={"grpc": args.shared_port, "http": args.http_port})

    async def close() -> None:
        await front.close()
        await registry.close()
        await policy.rate_limiter.close()
        await policy.request_ids.close()
        if peers is not None:
            await peers.close()

    # Sharing its ports, a draining gateway takes no new HTTP connection: the others do.
    stop_listening = front.stop_listening if args.shared_port else None
    await runtime.serve_until_signalled(args.drain_seconds, close, stop_listening)
    if link is not None:
        await link.close()


def main() -> None:
    args = parse_args_or_exit(build_parser())
    configure_logging("gateway", args.log_level)
    if args.processes > 1:  # a parent of gateways, serving nothing itself
        raise SystemExit(processes.run(args, sys.argv[1:]))
    start_observability("gateway", args)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

"""Which requests the gateway splits between a prefill and a decode pair: by the pairs' roles,
the request's sampling, and how much of its prompt the decode pair would compute (its cached
prefix, read from Redis like any route)."""

from __future__ import annotations

from services.gateway.mesh.connections import SchedulerBackend
from services.gateway.mesh.router import Router
from services.gateway.request.handover import split_roles, splittable, worth_splitting
from services.scheduler.redis_publisher import RedisPublisher
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2
from shared.sampling import SamplingParams
from tests.gateway.test_redis_routing import PROMPT, link, scheduler_service
from tests.redis_server import RedisServer
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import run_to_completion


def pair(address: str, role: str) -> SchedulerBackend:
    backend = SchedulerBackend(address)
    backend.model = common_pb2.ModelInfo(name="tiny", kv_block_size=4, serving_role=role)
    return backend


async def test_roles_split_the_candidates_and_prefill_pairs_serve_alone() -> None:
    prefill, decode, mixed = pair("p:1", "prefill"), pair("d:1", "decode"), pair("m:1", "")
    assert split_roles([prefill, decode, mixed]) == ([prefill], [decode, mixed])
    # No pair that decodes is ready: the prefill pairs take whole requests, none refused.
    assert split_roles([prefill]) == ([], [prefill])
    assert split_roles([mixed]) == ([], [mixed])


def test_sampling_that_reads_the_output_so_far_is_never_split() -> None:
    request = inference_pb2.GenerateRequest(n=1)
    assert splittable(request, SamplingParams(max_tokens=16))
    assert not splittable(request, SamplingParams(max_tokens=1))  # nothing left to hand over
    assert not splittable(request, SamplingParams(max_tokens=16, repetition_penalty=1.2))
    assert not splittable(inference_pb2.GenerateRequest(n=2), SamplingParams(max_tokens=16))


async def test_a_prompt_the_decode_pair_holds_skips_the_prefill_pair(
    redis_server: RedisServer,
) -> None:
    service = scheduler_service("d:1")
    assert service.loop.scheduler is not None
    service.loop.scheduler.add_request("warm", PROMPT, SamplingParams(max_tokens=1))
    run_to_completion(service.loop.scheduler, FakeWorker(4))
    await RedisPublisher(redis_server.url, "d:1", service).flush()
    router = Router(link(redis_server))
    decoding = [pair("d:1", "decode")]
    held = await router.route(decoding, PROMPT, b"")
    fresh = await router.route(decoding, [7] * len(PROMPT), b"")
    assert (held.uncached_tokens, fresh.uncached_tokens) == (1, len(PROMPT))
    assert not worth_splitting(held, 16) and worth_splitting(fresh, 16)
    assert not worth_splitting(fresh, len(PROMPT) + 1)  # under the threshold: no split

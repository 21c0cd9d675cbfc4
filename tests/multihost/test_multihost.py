"""The mesh across four hosts on one machine (network namespaces on a bridge): the gateway host
(gateway + tokenizer), two worker hosts (scheduler + engine-worker on the host's loopback each),
and Redis. Every service binds its host's address; nothing crosses a loopback between hosts.

Shown under a bounded load: requests spread over both worker hosts and cache-aware routing works
across them; cutting a worker host's link ends its in-flight streams with WORKER_LOST (gRPC
keepalive: 10 s ping, 5 s timeout), new requests succeed on the other host, and restoring the
link brings it back without a restart; cutting Redis's link degrades routing and admission to
local views with no failed request.

Needs root (network namespaces): `make test-multihost` runs it (`.ci/run` does); elsewhere it
skips with the reason.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb.kvmesh.v1 import inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.mesh_helpers import collect, ids_request
from tests.multihost.netns import Network, unavailable_reason

if os.environ.get("KVMESH_MULTIHOST") != "1":
    pytest.skip("multi-host tests run under `make test-multihost`", allow_module_level=True)
if (reason := unavailable_reason()) is not None:
    pytest.skip(f"multi-host tests skipped: {reason}", allow_module_level=True)

SCHEDULER_PORT, GATEWAY_PORT = 50071, 50051
LINK_LOSS_S = 25.0  # keepalive 10 s + timeout 5 s, with room for a loaded machine


class Cluster:
    def __init__(self, network: Network, log_dir: str) -> None:
        self.network = network
        self.log_dir = log_dir
        hosts = network.hosts
        self.gateway = f"{hosts['gw'].address}:{GATEWAY_PORT}"
        self.schedulers = {name: f"{hosts[name].address}:{SCHEDULER_PORT}" for name in ("w1", "w2")}
        self.redis_url = f"redis://{hosts['redis'].address}:6379/0"

    def log(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def start(self, model: str) -> None:
        hosts = self.network.hosts
        hosts["redis"].redis(self.log("redis"))
        common = ["--drain-seconds", "2"]
        for name in ("w1", "w2"):
            host = hosts[name]
            host.python(
                "services.engine_worker",
                ["--host", "127.0.0.1", "--port", "50061", "--model", model, "--threads", "1",
                 "--kv-memory", "16MiB", *common],
                self.log(f"engine-worker-{name}"),
            )  # fmt: skip
            host.python(
                "services.scheduler",
                ["--host", host.address, "--port", str(SCHEDULER_PORT), "--worker",
                 "127.0.0.1:50061", "--redis", self.redis_url, "--advertise",
                 self.schedulers[name], *common],
                self.log(f"scheduler-{name}"),
            )  # fmt: skip
        gw = hosts["gw"]
        gw.python(
            "services.tokenizer",
            ["--host", "127.0.0.1", "--port", "50081", "--model", model, *common],
            self.log("tokenizer"),
        )
        for address in self.schedulers.values():
            wait_serving(address, 120)
        gw.python(
            "services.gateway",
            ["--host", gw.address, "--port", str(GATEWAY_PORT), "--tokenizer", "127.0.0.1:50081",
             "--scheduler", ",".join(self.schedulers.values()), "--redis", self.redis_url,
             "--http-port", "0", *common],
            self.log("gateway"),
        )  # fmt: skip
        wait_serving(self.gateway, 60)


def wait_serving(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{address} not serving in {timeout_s} s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Network(["gw", "w1", "w2", "redis"]) as network:
        running = Cluster(network, str(tmp_path_factory.mktemp("multihost-logs")))
        running.start(tiny_llama_dir)
        yield running


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(length)]


async def scheduler_of(stub: inference_pb2_grpc.InferenceStub, prompt: list[int]) -> str:
    events = await collect(stub, ids_request(prompt, max_tokens=4, ignore_eos=True), timeout=60)
    assert events[-1].WhichOneof("event") == "completed", events[-1]
    return events[-1].completed.execution.scheduler


async def test_requests_spread_over_both_hosts_and_follow_their_cache(cluster: Cluster) -> None:
    rng = random.Random(1)
    async with grpc.aio.insecure_channel(cluster.gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        used = Counter(
            await asyncio.gather(*(scheduler_of(stub, random_prompt(rng, 40)) for _ in range(16)))
        )
        assert set(used) == set(cluster.schedulers.values()), used
        shared = random_prompt(rng, 64)  # 4 blocks, cached where the first request ran
        home = await scheduler_of(stub, [*shared, 7])
        await asyncio.sleep(1.0)  # the scheduler's prefix-cache set reaches Redis
        for suffix in range(5):
            request = ids_request([*shared, 8, suffix + 9], max_tokens=2)
            events = await collect(stub, request, timeout=60)
            routing = events[0].accepted.routing
            assert (routing.scheduler, routing.reason) == (home, "prefix"), routing
            assert routing.matched_blocks >= 3


async def read_until_delta(call: grpc.aio.UnaryStreamCall) -> str:
    while True:
        event = await call.read()
        kind = event.WhichOneof("event")
        if kind == "accepted":
            scheduler = event.accepted.routing.scheduler
        elif kind == "delta":
            return scheduler


async def test_a_cut_worker_host_fails_its_streams_and_comes_back(cluster: Cluster) -> None:
    host, lost = cluster.network.hosts["w1"], cluster.schedulers["w1"]
    pids = [p.pid for p in host.processes]
    async with grpc.aio.insecure_channel(cluster.gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = [
            stub.Generate(ids_request([5 + i, 6, 7], max_tokens=900, ignore_eos=True))
            for i in range(6)
        ]
        where = await asyncio.gather(*(read_until_delta(call) for call in calls))
        assert lost in where and cluster.schedulers["w2"] in where, where
        host.cut()
        cut_at = time.monotonic()

        async def rest(call: grpc.aio.UnaryStreamCall) -> tuple[str, str, float]:
            while (event := await call.read()) is not grpc.aio.EOF:
                kind = event.WhichOneof("event")
                if kind in ("completed", "cancelled", "failed"):
                    reason = event.failed.error.reason if kind == "failed" else ""
                    return kind, reason, time.monotonic() - cut_at
            raise AssertionError("no terminal event")

        ends = await asyncio.gather(*(rest(call) for call in calls))
        for scheduler, (kind, reason, after_s) in zip(where, ends, strict=True):
            if scheduler == lost:
                assert (kind, reason) == ("failed", "WORKER_LOST") and after_s < LINK_LOSS_S
            else:
                assert kind == "completed"  # the other host never noticed
        rng = random.Random(2)
        survivors = await asyncio.gather(
            *(scheduler_of(stub, random_prompt(rng, 20)) for _ in range(8))
        )
        assert set(survivors) == {cluster.schedulers["w2"]}
        host.restore()
        deadline = time.monotonic() + 30
        while lost not in set(
            await asyncio.gather(*(scheduler_of(stub, random_prompt(rng, 20)) for _ in range(4)))
        ):
            assert time.monotonic() < deadline, "the restored host never got traffic again"
            await asyncio.sleep(0.5)
    assert [p.pid for p in host.processes] == pids and all(
        p.poll() is None for p in host.processes
    )  # nothing restarted
    with grpc.insecure_channel(lost) as channel:  # its blocks came back too
        load_stub = scheduler_pb2_grpc.SchedulerStub(channel)
        deadline = time.monotonic() + LINK_LOSS_S
        while True:
            load = load_stub.GetLoad(scheduler_pb2.LoadRequest(), timeout=5)
            if not (load.num_open_streams or load.num_blocks_referenced or load.num_running):
                break
            assert time.monotonic() < deadline, load
            time.sleep(0.2)


async def test_a_cut_redis_degrades_with_no_failed_request(cluster: Cluster) -> None:
    redis = cluster.network.hosts["redis"]
    rng = random.Random(3)
    async with grpc.aio.insecure_channel(cluster.gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        redis.cut()
        try:
            outcomes = await asyncio.gather(
                *(
                    collect(stub, ids_request(random_prompt(rng, 30), max_tokens=8), timeout=60)
                    for _ in range(16)
                )
            )
            assert all(o[-1].WhichOneof("event") == "completed" for o in outcomes)
            reasons = {o[0].accepted.routing.reason for o in outcomes}
            assert "local-fallback" in reasons, reasons
        finally:
            redis.restore()
        await asyncio.sleep(6)  # the circuit breaker tries Redis again
        outcomes = await asyncio.gather(
            *(collect(stub, ids_request(random_prompt(rng, 30), max_tokens=4)) for _ in range(4))
        )
        assert all(o[-1].WhichOneof("event") == "completed" for o in outcomes)
    with open(cluster.log("gateway")) as log:
        text = log.read()
    assert "redis unreachable; degrading" in text and "redis reachable again" in text

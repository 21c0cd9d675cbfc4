"""The prefill/decode split across hosts (network namespaces on a bridge): the gateway host
(gateway + tokenizer), a prefill host and a decode host (a scheduler + engine-worker pair each)
and Redis. The decode worker pulls a request's blocks from the prefill worker's host address.

Shown: a long prompt is prefilled on one host and decoded on the other, token for token what
the decode host computes alone; with the link between the two hosts cut while handovers are
under way (their pulls slowed to seconds, then blackholed), every request in flight gets the
configured outcome: recomputed and completed (`--kv-load-failure recompute`), or failed with
KV_HANDOVER_FAILED (`fail`); no block is left held on either host.

Needs root (network namespaces): `make test-multihost` runs it; elsewhere it skips.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest

from shared.pb.kvmesh.v1 import inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.mesh_helpers import collect, ids_request, output_ids
from tests.multihost.netns import Network, unavailable_reason
from tests.multihost.test_multihost import GATEWAY_PORT, SCHEDULER_PORT, wait_serving

if os.environ.get("KVMESH_MULTIHOST") != "1":
    pytest.skip("multi-host tests run under `make test-multihost`", allow_module_level=True)
if (reason := unavailable_reason()) is not None:
    pytest.skip(f"multi-host tests skipped: {reason}", allow_module_level=True)

WORKER_PORT = 50061
PROMPTS = [[(11 * i + 7 * k) % 400 + 3 for i in range(400)] for k in range(4)]  # 25 blocks each


def ip_in(namespace: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, *args], check=True, capture_output=True)


class SplitCluster:
    def __init__(self, network: Network, log_dir: str, model: str) -> None:
        self.network, self.log_dir, self.model = network, log_dir, model
        hosts = network.hosts
        self.gateway = f"{hosts['gw'].address}:{GATEWAY_PORT}"
        self.prefill = f"{hosts['pf'].address}:{SCHEDULER_PORT}"
        self.decode = f"{hosts['dc'].address}:{SCHEDULER_PORT}"
        self.prefill_worker = f"{hosts['pf'].address}:{WORKER_PORT}"
        self.redis_url = f"redis://{hosts['redis'].address}:6379/0"
        self.decode_scheduler: subprocess.Popen[bytes] | None = None

    def log(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def start(self) -> None:
        hosts, common = self.network.hosts, ["--drain-seconds", "2"]
        hosts["redis"].redis(self.log("redis"))
        worker = ["--model", self.model, "--threads", "1", "--kv-memory", "16MiB", *common]
        # The prefill worker listens on its host's address: the decode worker pulls from it.
        hosts["pf"].python(
            "services.engine_worker",
            ["--host", hosts["pf"].address, "--port", str(WORKER_PORT), *worker],
            self.log("engine-worker-pf"),
        )
        hosts["pf"].python(
            "services.scheduler",
            ["--host", hosts["pf"].address, "--port", str(SCHEDULER_PORT), "--worker",
             self.prefill_worker, "--redis", self.redis_url, "--role", "prefill",
             "--handover-lease-s", "8", *common],
            self.log("scheduler-pf"),
        )  # fmt: skip
        hosts["dc"].python(
            "services.engine_worker",
            ["--host", "127.0.0.1", "--port", str(WORKER_PORT), *worker],
            self.log("engine-worker-dc"),
        )
        self.start_decode_scheduler("recompute")
        gw = hosts["gw"]
        gw.python(
            "services.tokenizer",
            ["--host", "127.0.0.1", "--port", "50081", "--model", self.model, *common],
            self.log("tokenizer"),
        )
        wait_serving(self.prefill, 120)
        wait_serving(self.decode, 120)
        gw.python(
            "services.gateway",
            ["--host", gw.address, "--port", str(GATEWAY_PORT), "--tokenizer", "127.0.0.1:50081",
             "--scheduler", f"{self.prefill},{self.decode}", "--redis", self.redis_url,
             "--handover-min-tokens", "64", "--http-port", "0", *common],
            self.log("gateway"),
        )  # fmt: skip
        wait_serving(self.gateway, 60)

    def start_decode_scheduler(self, policy: str) -> None:
        """The decode host's scheduler (again), with this `--kv-load-failure` policy."""
        if self.decode_scheduler is not None:
            os.killpg(self.decode_scheduler.pid, signal.SIGKILL)
            self.decode_scheduler.wait()
        dc = self.network.hosts["dc"]
        self.decode_scheduler = dc.python(
            "services.scheduler",
            ["--host", dc.address, "--port", str(SCHEDULER_PORT), "--worker",
             f"127.0.0.1:{WORKER_PORT}", "--redis", self.redis_url, "--role", "decode",
             "--handover-timeout-s", "3", "--kv-load-failure", policy, "--drain-seconds", "2"],
            self.log(f"scheduler-dc-{policy}"),
        )  # fmt: skip

    def slow_the_pulls(self) -> None:
        """What the prefill host sends the decode host slowed to ~64 kB/s (a pull takes
        seconds); all else, the gateway's streams to both included, as it was. Shaped on the
        bridge's port to the decode host, matching the prefill host's address."""
        port, prefill_host = self.network.hosts["dc"].link, self.network.hosts["pf"].address
        for command in (
            ["qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "10"],
            ["class", "add", "dev", port, "parent", "1:", "classid", "1:10", "htb", "rate",
             "10gbit"],
            ["class", "add", "dev", port, "parent", "1:", "classid", "1:20", "htb", "rate",
             "512kbit", "ceil", "512kbit"],
            ["qdisc", "add", "dev", port, "parent", "1:20", "pfifo", "limit", "50"],
            ["filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "src", f"{prefill_host}/32", "flowid", "1:20"],
        ):  # fmt: skip
            subprocess.run(["tc", *command], check=True, capture_output=True)

    def cut_between(self) -> None:
        """The decode host loses its route to the prefill host (the gateway keeps both)."""
        prefill_host = self.network.hosts["pf"].address
        ip_in(self.network.hosts["dc"].namespace, "ip", "route", "add", "blackhole", prefill_host)

    def restore(self) -> None:
        hosts = self.network.hosts
        prefill_host = hosts["pf"].address
        blackhole = ["ip", "route", "del", "blackhole", prefill_host]
        subprocess.run(
            ["ip", "netns", "exec", hosts["dc"].namespace, *blackhole],
            check=False,
            capture_output=True,
        )
        subprocess.run(
            ["tc", "qdisc", "del", "dev", hosts["dc"].link, "root"],
            check=False,
            capture_output=True,
        )


@pytest.fixture(scope="module")
def cluster(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SplitCluster]:
    with Network(["gw", "pf", "dc", "redis"]) as network:
        running = SplitCluster(network, str(tmp_path_factory.mktemp("pd-logs")), tiny_llama_dir)
        running.start()
        yield running


def greedy(prompt: list[int]):  # type: ignore[no-untyped-def]
    return ids_request(prompt, max_tokens=6, ignore_eos=True, temperature=0.0)


async def idle(address: str, timeout_s: float = 30) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            load = await stub.GetLoad(scheduler_pb2.LoadRequest(), timeout=5)
            if not (load.num_open_streams or load.num_blocks_referenced or load.num_running):
                return
            assert time.monotonic() < deadline, f"{address} holds blocks: {load}"
            await asyncio.sleep(0.2)


async def handovers_under_a_cut(cluster: SplitCluster, prompts: list[list[int]]) -> list:
    """The prompts at once; once each has its first token (their pulls under way, slowed),
    the link between the hosts is cut. Every request's events."""
    cluster.slow_the_pulls()
    try:
        async with grpc.aio.insecure_channel(cluster.gateway) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            calls = [stub.Generate(greedy(p), timeout=120) for p in prompts]

            async def events_of(call: grpc.aio.UnaryStreamCall) -> list:
                events = []
                while (event := await call.read()) is not grpc.aio.EOF:
                    events.append(event)
                    if event.HasField("delta"):
                        first_tokens.release()  # once per delta; the wait below takes all
                return events

            first_tokens = asyncio.Semaphore(0)
            reading = [asyncio.create_task(events_of(call)) for call in calls]
            for _ in calls:  # each request has streamed its first token
                await first_tokens.acquire()
            await asyncio.sleep(0.5)  # the handovers' pulls are running, slowed
            cluster.cut_between()
            return await asyncio.gather(*reading)
    finally:
        cluster.restore()


async def until_the_gateway_decodes_on(gateway: str, decode: str, timeout_s: float = 30) -> None:
    """Short prompts (never split) land on the restarted decode pair once the gateway's health
    watch has seen it again; until then the prefill pair serves them whole."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while True:
            events = await collect(stub, greedy([5, 6, 7]), timeout=30)
            if events[-1].completed.execution.scheduler == decode:
                return
            assert time.monotonic() < deadline, "the gateway never saw the decode pair again"
            await asyncio.sleep(0.2)


async def computed_alone(address: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt on one scheduler, in a cache namespace of their own (no
    prefix of the mesh's requests touched)."""
    outputs = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for index, prompt in enumerate(prompts):
            call = stub.Submit(
                scheduler_pb2.SubmitRequest(
                    request_id=f"reference-{index}-{time.monotonic_ns()}",
                    token_ids=prompt,
                    sampling=greedy(prompt).sampling,
                    cache_salt=b"reference",
                ),
                timeout=60,
            )
            events = [event async for event in call]
            outputs.append([t for e in events if e.HasField("tokens") for t in e.tokens.token_ids])
    return outputs


async def test_split_across_hosts_and_a_cut_link_follows_the_policy(cluster: SplitCluster) -> None:
    cut_prompts = [[p[0] + 2, *p[1:]] for p in PROMPTS]  # nothing of them cached anywhere
    reference = await computed_alone(cluster.decode, [*PROMPTS, *cut_prompts])
    async with grpc.aio.insecure_channel(cluster.gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        split = [await collect(stub, greedy(p), timeout=60) for p in PROMPTS]
    for events, want in zip(split, reference[: len(PROMPTS)], strict=True):
        execution = events[-1].completed.execution
        assert execution.scheduler == cluster.decode
        handover = execution.handover
        assert (handover.prefill_worker, handover.outcome) == (cluster.prefill_worker, "ok")
        assert output_ids(events) == want and len(want) == 6

    recomputed = await handovers_under_a_cut(cluster, cut_prompts)
    for events, want in zip(recomputed, reference[len(PROMPTS) :], strict=True):
        assert events[-1].WhichOneof("event") == "completed", events[-1]
        handover = events[-1].completed.execution.handover
        assert handover.outcome == "timeout" and handover.blocks < len(PROMPTS[0]) // 16
        assert output_ids(events) == want  # recomputed past what arrived
    await idle(cluster.decode)
    await idle(cluster.prefill)

    cluster.start_decode_scheduler("fail")
    wait_serving(cluster.decode, 60)
    await until_the_gateway_decodes_on(cluster.gateway, cluster.decode)
    failed = await handovers_under_a_cut(cluster, [[p[0] + 3, *p[1:]] for p in PROMPTS])
    for events in failed:
        assert events[-1].WhichOneof("event") == "failed", events[-1]
        assert events[-1].failed.error.reason == "KV_HANDOVER_FAILED"
        assert any(e.HasField("delta") for e in events)  # the first token was out already
    await idle(cluster.decode)
    await idle(cluster.prefill)

"""What a rollout costs the traffic flowing through it: SmolLM2 v1 serving steady streams, then
`deploy v2` and `rollback` while they keep coming (the same weights added twice to a temporary
repository: the cost measured is the rollout's, not a different model's).

Figures: seconds each rollout took (start the pair, load, warm, fixture, shift, drain, stop);
requests completed and failed; TTFT p50/p99 while nothing moves (before) against while a
rollout runs (the new worker loads on the same cores), and the ratio.
Run: make bench-rollout
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Iterator

import grpc

from kvmesh.mesh.launcher import Mesh, MeshConfig
from kvmesh.mesh.rollout import RolloutController
from kvmesh.models_cli import record_fixtures
from shared.model_entry import ServingConfig
from shared.model_paths import default_model_path
from shared.model_repository import ModelRepository
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

PROMPTS = ["Name a color.", "What is 2 + 2?", "Say hello.", "Name a fruit."]


class Traffic:
    def __init__(self, address: str, concurrency: int, max_tokens: int) -> None:
        self.records: list[tuple[float, float, str, str]] = []  # start, ttft, outcome, version
        self.address, self.concurrency, self.max_tokens = address, concurrency, max_tokens
        self.stopping = False

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await asyncio.gather(*(self._client(stub, i) for i in range(self.concurrency)))

    async def _client(self, stub: inference_pb2_grpc.InferenceStub, index: int) -> None:
        sequence = index
        while not self.stopping:
            messages = [common_pb2.ChatMessage(role="user", content=PROMPTS[sequence % 4])]
            request = inference_pb2.GenerateRequest(
                model="smollm2",
                chat=common_pb2.Chat(messages=messages),
                sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0.0),
            )
            started = time.perf_counter()
            ttft, outcome, version = 0.0, "none", ""
            try:
                async for event in stub.Generate(request, timeout=120):
                    kind = event.WhichOneof("event")
                    if kind == "accepted":
                        version = event.accepted.model_version
                    elif kind == "delta" and not ttft:
                        ttft = time.perf_counter() - started
                    elif kind in ("completed", "cancelled", "failed"):
                        outcome = kind
            except grpc.RpcError as error:
                outcome = f"refused {error.code().name}"
            self.records.append((started, ttft, outcome, version))
            sequence += self.concurrency


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] if ordered else 0.0


def window(records: list, start: float, end: float) -> list:
    return [r for r in records if start <= r[0] < end]


def describe(name: str, records: list) -> str:
    ttfts = [r[1] * 1e3 for r in records if r[2] == "completed"]
    failed = sum(r[2] != "completed" for r in records)
    return (
        f"  {name:18} {len(records):4} requests, {failed} not completed; TTFT p50 "
        f"{percentile(ttfts, 0.5):6.0f} ms, p99 {percentile(ttfts, 0.99):6.0f} ms"
    )


async def bench(args: argparse.Namespace, repo: str) -> None:
    config = MeshConfig(
        models=["smollm2@1"], model_repo=repo, http_port=None, tracing=False, drain_seconds=30
    )
    with Mesh(config) as mesh:
        controller = RolloutController(mesh)
        traffic = Traffic(mesh.gateway_address, args.concurrency, args.max_tokens)
        running = asyncio.create_task(traffic.run())
        began = time.perf_counter()
        await asyncio.sleep(args.steady_s)
        moves: list[tuple[str, float, float]] = []
        for name, steps in (
            ("deploy v2", controller.deploy("smollm2", "2")),
            ("rollback to v1", controller.rollback("smollm2")),
        ):
            started = time.perf_counter()
            await asyncio.to_thread(_drain, steps)
            moves.append((name, started, time.perf_counter()))
            await asyncio.sleep(args.steady_s / 2)
        traffic.stopping = True
        await running
    records = traffic.records
    steady = window(records, began, moves[0][1])
    during = [r for _, start, end in moves for r in window(records, start, end)]
    print(f"SmolLM2-135M, {args.concurrency} streams at a time, {args.max_tokens} tokens each:")
    for name, start, end in moves:
        print(f"  {name:18} {end - start:6.1f} s")
    print(describe("steady (before)", steady))
    print(describe("during rollouts", during))
    print(describe("all", records))
    versions = sorted({r[3] for r in records})
    print(f"  versions that answered: {', '.join(versions)}")
    steady_p99 = percentile([r[1] for r in steady if r[2] == "completed"], 0.99)
    during_p99 = percentile([r[1] for r in during if r[2] == "completed"], 0.99)
    if steady_p99:
        print(f"  TTFT p99 during / before: {during_p99 / steady_p99:.2f}x")


def _drain(steps: Iterator[object]) -> None:
    for _ in steps:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--steady-s", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-repo-") as repo:
        repository = ModelRepository(repo)
        for _ in range(2):
            entry = repository.add(
                "smollm2", default_model_path(), serving=ServingConfig(kv_memory="128MiB")
            )
            record_fixtures(entry, ["The capital of France is"], 4)
        asyncio.run(bench(args, repo))


if __name__ == "__main__":
    main()

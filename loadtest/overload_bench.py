"""Admission under overload, as figures: the mesh's closed-loop capacity, then 3x that offered
open-loop; completed requests' TTFT p50/p99 against the queue SLO, and how fast OVERLOADED
refusals come back. tests/e2e/test_mesh_overload.py drives the same load and asserts only what
must hold on any machine (answers or OVERLOADED with RetryInfo, flat memory, blocks back).
Run: make bench-overload
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass

import grpc

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared import grpc_errors
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

MAX_QUEUE_MS = 2000  # about two requests' drain time beyond the free slots
OUTPUT_TOKENS = 32


def overload_mesh_config(log_dir: str) -> MeshConfig:
    """Two pairs of the default model with a small, clear capacity (4 sequences each)."""
    return MeshConfig(
        workers=2,
        worker_threads=1,
        worker_args=["--kv-memory", "64MiB"],
        scheduler_args=["--max-num-seqs", "4"],
        gateway_args=["--max-queue-ms", str(MAX_QUEUE_MS)],
        log_dir=log_dir,
        drain_seconds=2,
    )


@dataclass
class Outcome:
    kind: str  # "completed", "cancelled", "failed", or the refusal's reason
    seconds: float  # to the first token (completed) or to the refusal
    retry_ms: int = 0


async def one_request(
    stub: inference_pb2_grpc.InferenceStub, index: int, metadata: tuple = ()
) -> Outcome:
    request = inference_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[5, 6, index % 100 + 7]),
        sampling=common_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True),
    )
    started = time.monotonic()
    ttft = None
    try:
        async for event in stub.Generate(request, timeout=60, metadata=metadata):
            kind = event.WhichOneof("event")
            if ttft is None and kind == "delta":
                ttft = time.monotonic() - started
            if kind in ("cancelled", "failed"):
                return Outcome(kind, 0.0)
    except grpc.aio.AioRpcError as error:
        refusal = grpc_errors.from_rpc_error(error)
        return Outcome(refusal.reason.value, time.monotonic() - started, refusal.retry_after_ms)
    return Outcome("completed", ttft or 0.0)


async def closed_loop_rate(
    stub: inference_pb2_grpc.InferenceStub, seconds: float, metadata: tuple = ()
) -> float:
    """Completed requests per second with every sequence slot busy: the mesh's capacity."""
    done = 0
    stop = time.monotonic() + seconds

    async def client(worker: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            outcome = await one_request(stub, worker, metadata)
            if outcome.kind != "completed":
                raise AssertionError(f"a closed loop within capacity was refused: {outcome}")
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(8)))
    return done / (time.monotonic() - started)


async def offer(stub: inference_pb2_grpc.InferenceStub, rate: float, seconds: float) -> list:
    """Requests at a steady `rate` (open loop: arrivals never wait for answers)."""
    tasks = []
    started = time.monotonic()
    for index in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one_request(stub, index)))
    return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: int) -> float:
    # Inclusive: linear between samples, never past the largest; the default ("exclusive")
    # extrapolates beyond the maximum on a few dozen samples.
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def run(factor: float, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as logs, Mesh(overload_mesh_config(logs)) as mesh:
        async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            capacity = await closed_loop_rate(stub, 5.0)
            outcomes = await offer(stub, factor * capacity, seconds)
    completed = [o.seconds for o in outcomes if o.kind == "completed"]
    refused = [o.seconds for o in outcomes if o.kind == "OVERLOADED"]
    slo_s = MAX_QUEUE_MS / 1e3
    print(f"capacity (closed loop, 8 clients): {capacity:.2f} req/s")
    print(f"offered: {factor:.1f}x = {factor * capacity:.2f} req/s for {seconds:.0f} s")
    print("| outcome | requests | p50 ms | p99 ms |")
    print("| --- | --- | --- | --- |")
    for name, values in (("completed (TTFT)", completed), ("OVERLOADED (refusal)", refused)):
        p50, p99 = percentile(values, 50) * 1e3, percentile(values, 99) * 1e3
        print(f"| {name} | {len(values)} | {p50:.0f} | {p99:.0f} |")
    others = sorted({o.kind for o in outcomes} - {"completed", "OVERLOADED"})
    print(f"other outcomes: {others or 'none'}")
    print(
        f"TTFT p99 / queue SLO ({slo_s:.1f} s): {percentile(completed, 99) / slo_s:.2f}x; "
        f"served {len(completed) / max(1, len(outcomes)):.0%} of offered"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--factor", type=float, default=3.0, help="offered load / capacity")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(run(args.factor, args.seconds))


if __name__ == "__main__":
    main()

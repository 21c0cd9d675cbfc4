"""Fair share across tenants: tenant A floods at 5x the mesh's capacity while tenant B sends a
light, steady load; B's TTFT is measured alone, beside A's flood, and beside the same flood
sent under B's own tenant (what B would see with FCFS and no tenants), all in one run.

The gateway's queue watermarks are off here, so nothing is refused: the whole flood queues at
the scheduler and the fair share alone decides who waits. Goal: B's TTFT p99 beside the flood
within 2x of B alone. The queue and prefill columns are the scheduler's split of B's first token
(arrival to first step, first step to first token): B's prefill runs in a step of its own
(prefill first, fair_share.py), so beside the flood it costs what it costs alone, and what
remains is the step in flight when B arrives. B sends 30 requests a phase: the p99 is close to
the slowest of them.
Run: make bench-fairness
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest.overload_bench import closed_loop_rate, percentile
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

OUTPUT_TOKENS = 32
NO_WATERMARKS = ("--max-queue-ms", "0", "--max-queue-tokens", "0")
KEYS = """
[tenants.a]
keys = ["sk-a"]

[tenants.b]
keys = ["sk-b"]
"""


@dataclass(frozen=True)
class FirstToken:
    """Seconds from sending to the first delta, and the scheduler's split of it."""

    ttft: float
    queue: float  # arrival at the scheduler until its first step
    prefill: float  # first step until the first token


async def one(stub: inference_pb2_grpc.InferenceStub, key: str, index: int) -> FirstToken | None:
    """None when it did not complete."""
    request = inference_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[11, 12, index % 200 + 20, 13]),
        sampling=common_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True),
    )
    started, ttft = time.monotonic(), None
    try:
        call = stub.Generate(request, metadata=(("x-api-key", key),), timeout=600)
        async for event in call:
            kind = event.WhichOneof("event")
            if kind == "delta" and ttft is None:
                ttft = time.monotonic() - started
            elif kind == "completed" and ttft is not None:
                timings = event.completed.timings
                return FirstToken(ttft, timings.queue_ms / 1e3, timings.prefill_ms / 1e3)
            elif kind in ("failed", "cancelled"):
                return None
    except grpc.RpcError:
        return None
    return None


async def steady(
    stub: inference_pb2_grpc.InferenceStub,
    key: str,
    rate: float,
    seconds: float,
    sent: asyncio.Event | None = None,
) -> list[FirstToken | None]:
    """Open loop at `rate`; sets `sent` after the last send, then waits for every answer."""
    tasks = []
    started = time.monotonic()
    for index in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(stub, key, index)))
    if sent is not None:
        sent.set()
    return list(await asyncio.gather(*tasks))


async def flood(
    stub: inference_pb2_grpc.InferenceStub, key: str, rate: float, stop: asyncio.Event
) -> int:
    """Open loop at `rate` until `stop`; what is still queued then is cancelled."""
    tasks: list[asyncio.Task[FirstToken | None]] = []
    started = time.monotonic()
    while not stop.is_set():
        tasks.append(asyncio.create_task(one(stub, key, len(tasks))))
        next_at = started + len(tasks) / rate
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return len(tasks)


async def b_beside_flood(
    stub: inference_pb2_grpc.InferenceStub, flood_key: str, args: argparse.Namespace, rate: float
) -> tuple[list[FirstToken | None], int]:
    stop = asyncio.Event()
    flooding = asyncio.create_task(flood(stub, flood_key, rate, stop))
    await asyncio.sleep(args.warm_seconds)  # a queue builds up first
    if flood_key == "sk-b":
        # FCFS: the flood stops (its queue cancelled) once B has sent its last request;
        # behind an endless FCFS queue B's last requests would wait for minutes. This
        # flatters FCFS, if anything.
        b = await steady(stub, "sk-b", args.b_rate, args.seconds, sent=stop)
    else:
        # Fair share: the flood goes on until B's last answer. (Stopped at B's last send,
        # that request's first token met hundreds of cancellations: the slowest of B's 30,
        # so the p99, measured the flood's teardown, not the share.)
        b = await steady(stub, "sk-b", args.b_rate, args.seconds)
        stop.set()
    return b, await flooding


TABLE_HEAD = (
    "| tenant B's requests | completed | TTFT p50 ms | TTFT p99 ms | p99 / alone "
    "| queue p50 / p99 ms | prefill p50 / p99 ms |\n| --- | --- | --- | --- | --- | --- | --- |"
)


def two_tenant_config(
    directory: str, kv_memory: str, scheduler_args: list[str], gateway_args: list[str]
) -> MeshConfig:
    """A mesh of the default model whose gateway knows tenants a and b (KEYS)."""
    keys = Path(directory) / "keys.toml"
    keys.write_text(KEYS)
    return MeshConfig(
        worker_threads=2,
        worker_args=["--kv-memory", kv_memory],
        scheduler_args=scheduler_args,
        gateway_args=["--api-keys-file", str(keys), *gateway_args],
        log_dir=directory,
        drain_seconds=2,
    )


def row(name: str, results: list[FirstToken | None], alone_p99: float) -> str:
    done = [r for r in results if r is not None]
    ttft = [r.ttft for r in done]
    p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
    ratio = p99 / alone_p99 if alone_p99 else 0.0
    queue, prefill = [r.queue for r in done], [r.prefill for r in done]
    return (
        f"| {name} | {len(done)}/{len(results)} | {p50 * 1e3:.0f} | {p99 * 1e3:.0f} | "
        f"{ratio:.2f}x | {percentile(queue, 50) * 1e3:.0f} / {percentile(queue, 99) * 1e3:.0f} | "
        f"{percentile(prefill, 50) * 1e3:.0f} / {percentile(prefill, 99) * 1e3:.0f} |"
    )


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as directory:
        scheduler_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "100000"]
        # Watermarks off: nothing is refused, the whole flood queues at the scheduler.
        config = two_tenant_config(directory, "128MiB", scheduler_args, list(NO_WATERMARKS))
        with Mesh(config) as mesh:
            async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                capacity = await closed_loop_rate(stub, 8.0, (("x-api-key", "sk-a"),))
                alone = await steady(stub, "sk-b", args.b_rate, args.seconds)
                flood_rate = args.factor * capacity
                fair, sent_a = await b_beside_flood(stub, "sk-a", args, flood_rate)
                await asyncio.sleep(2.0)  # cancelled flood requests leave the queue
                fcfs, sent_same = await b_beside_flood(stub, "sk-b", args, flood_rate)
    alone_p99 = percentile([r.ttft for r in alone if r is not None], 99)
    print(f"capacity (closed loop, 8 clients): {capacity:.2f} req/s, {OUTPUT_TOKENS} tokens each")
    print(
        f"B: {args.b_rate} req/s for {args.seconds:.0f} s; flood: {args.factor:.0f}x capacity "
        f"= {flood_rate:.1f} req/s ({sent_a} and {sent_same} sent), queued from "
        f"{args.warm_seconds:.0f} s before B starts"
    )
    print(TABLE_HEAD)
    print(row("alone", alone, alone_p99))
    print(row("beside tenant A's flood (fair share)", fair, alone_p99))
    print(row("beside the same flood in B's own tenant (FCFS)", fcfs, alone_p99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--factor", type=float, default=5.0, help="A's rate / capacity")
    parser.add_argument("--b-rate", type=float, default=0.5, help="B's requests per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="B's sending time per phase")
    parser.add_argument("--warm-seconds", type=float, default=5.0)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

"""`make soak`: a mixed workload against the whole mesh (the default model) for a set time,
then the invariants: requests by outcome, p99 TTFT/TPOT per window, errors by reason, KV blocks
still referenced once idle (must be 0), and each service's resident memory growth.

Mix: plain streams, streams the client cancels mid-way, deadlines too short to finish,
structured output (json_object), and bad input (each must be refused with its own reason).
Exits 1 when a block or a stream leaked, or a request ended INTERNAL.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
from dataclasses import dataclass

import grpc

from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest.report import percentile
from shared import grpc_errors
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

PROMPTS = [
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain what a KV cache is in one paragraph.",
    "Give a short recipe for tea.",
]
BAD_INPUTS = [  # (request, the reason it must get)
    (inference_pb2.GenerateRequest(text=""), "EMPTY_PROMPT"),
    (
        inference_pb2.GenerateRequest(text="x", sampling={"temperature": -1}),
        "INVALID_SAMPLING_PARAMS",
    ),
    (inference_pb2.GenerateRequest(text="x", model="no-such-model"), "MODEL_NOT_FOUND"),
    (inference_pb2.GenerateRequest(token_ids={"ids": [10**8]}), "INVALID_ARGUMENT"),
    (
        inference_pb2.GenerateRequest(
            text="x", sampling={"response_format": {"kind": "json_schema", "spec": "{"}}
        ),
        "INVALID_SCHEMA",
    ),
]


@dataclass
class Outcome:
    started: float
    kind: str
    outcome: str  # completed, cancelled, failed, refused
    reason: str
    ttft_s: float | None
    tpot_s: float | None


def sampling(**fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]


async def one_request(
    stub: inference_pb2_grpc.InferenceStub, rng: random.Random, began: float
) -> Outcome:
    roll = rng.random()
    prompt = rng.choice(PROMPTS)
    cancel_after = 0
    expected_reason = ""
    if roll < 0.45:
        kind, request = (
            "stream",
            inference_pb2.GenerateRequest(
                text=prompt, sampling=sampling(max_tokens=rng.randint(8, 64))
            ),
        )
    elif roll < 0.6:
        kind, cancel_after = "cancel", rng.randint(1, 8)
        request = inference_pb2.GenerateRequest(text=prompt, sampling=sampling(max_tokens=64))
    elif roll < 0.7:
        kind = "deadline"
        request = inference_pb2.GenerateRequest(
            text=prompt, sampling=sampling(max_tokens=128), timeout_ms=rng.randint(100, 600)
        )
    elif roll < 0.8:
        kind = "structured"
        request = inference_pb2.GenerateRequest(
            text="Describe a cat as JSON.",
            sampling=sampling(max_tokens=48, response_format={"kind": "json_object"}),
        )
    else:
        kind = "bad_input"
        request, expected_reason = rng.choice(BAD_INPUTS)
    started = time.monotonic()
    first: float | None = None
    tokens = 0
    call = stub.Generate(request, timeout=120)
    try:
        async for event in call:
            which = event.WhichOneof("event")
            if which == "delta" and event.delta.token_ids:
                tokens += len(event.delta.token_ids)
                first = first or time.monotonic()
                if cancel_after and tokens >= cancel_after:
                    call.cancel()
                    return Outcome(started - began, kind, "cancelled", "client", None, None)
            elif which in ("completed", "cancelled"):
                end = time.monotonic()
                ttft = None if first is None else first - started
                tpot = (end - first) / (tokens - 1) if first and tokens > 1 else None
                return Outcome(started - began, kind, which, "", ttft, tpot)
            elif which == "failed":
                return Outcome(
                    started - began, kind, "failed", event.failed.error.reason, None, None
                )
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED and cancel_after:
            return Outcome(started - began, kind, "cancelled", "client", None, None)
        reason = grpc_errors.from_rpc_error(error).reason.value
        if expected_reason and reason != expected_reason:
            reason = f"WRONG:{reason}!={expected_reason}"
        return Outcome(started - began, kind, "refused", reason, None, None)
    return Outcome(started - began, kind, "failed", "NO_TERMINAL_EVENT", None, None)


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def soak(mesh: Mesh, duration_s: float, concurrency: int, seed: int) -> list[Outcome]:
    outcomes: list[Outcome] = []
    began = time.monotonic()
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() - began < duration_s:
                outcomes.append(await one_request(stub, rng, began))

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return outcomes


async def idle_load(mesh: Mesh) -> list[scheduler_pb2.LoadReport]:
    reports = []
    for address in mesh.scheduler_addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            for _ in range(100):
                load = await stub.GetLoad(scheduler_pb2.LoadRequest())
                if not (load.num_running or load.num_waiting or load.num_open_streams):
                    break
                await asyncio.sleep(0.1)
            reports.append(load)
    return reports


def report(
    outcomes: list[Outcome],
    loads: list[scheduler_pb2.LoadReport],
    memory: dict[str, tuple[int, int]],
    window_s: float,
) -> bool:
    print("\n## Requests by kind and outcome\n")
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        table[o.kind][o.outcome] += 1
    columns = ["completed", "cancelled", "failed", "refused"]
    print("| kind | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for kind, counts in sorted(table.items()):
        print(f"| {kind} | " + " | ".join(str(counts[c]) for c in columns) + " |")
    print(f"\n## p99 over time ({window_s:.0f} s windows, completed streams)\n")
    print("| window | requests | p99 TTFT ms | p99 TPOT ms |\n|---|---|---|---|")
    windows: dict[int, list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        windows[int(o.started // window_s)].append(o)
    for index, items in sorted(windows.items()):
        ttfts = [o.ttft_s * 1e3 for o in items if o.ttft_s is not None]
        tpots = [o.tpot_s * 1e3 for o in items if o.tpot_s is not None]
        ttft = f"{percentile(ttfts, 99):.0f}" if ttfts else "-"
        tpot = f"{percentile(tpots, 99):.1f}" if tpots else "-"
        window = f"{index * window_s:.0f}-{(index + 1) * window_s:.0f} s"
        print(f"| {window} | {len(items)} | {ttft} | {tpot} |")
    print("\n## Errors by reason\n")
    reasons = collections.Counter(o.reason for o in outcomes if o.outcome in ("failed", "refused"))
    print("| reason | count |\n|---|---|")
    for reason, count in reasons.most_common():
        print(f"| {reason} | {count} |")
    leaked_blocks = sum(load.num_blocks_referenced for load in loads)
    leaked_streams = sum(
        load.num_open_streams + load.num_running + load.num_waiting for load in loads
    )
    print(f"\n## After the load\n\nleaked KV blocks: {leaked_blocks}")
    print(f"requests left queued, running or open: {leaked_streams}\n")
    print(
        "| service | RSS after warm-up MiB | RSS at the end MiB | growth MiB |\n|---|---|---|---|"
    )
    for name, (start, end) in memory.items():
        print(
            f"| {name} | {start / 2**20:.0f} | {end / 2**20:.0f} | {(end - start) / 2**20:+.1f} |"
        )
    bad = [r for r in reasons if r in ("INTERNAL", "NO_TERMINAL_EVENT") or r.startswith("WRONG")]
    ok = leaked_blocks == 0 and leaked_streams == 0 and not bad
    print(f"\nverdict: {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(prog="loadtest.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per p99 row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    config = MeshConfig(
        workers=args.workers, worker_args=["--kv-memory", "256MiB"], http_port=None, drain_seconds=5
    )
    with Mesh(config) as mesh:
        asyncio.run(soak(mesh, 20.0, args.concurrency, args.seed + 1))  # warm-up, not reported
        start = {s.name: resident_bytes(s.process.pid) for s in mesh.services}
        print(f"soaking {args.duration:.0f} s at concurrency {args.concurrency}...", flush=True)
        outcomes = asyncio.run(soak(mesh, args.duration, args.concurrency, args.seed))
        loads = asyncio.run(idle_load(mesh))
        memory = {s.name: (start[s.name], resident_bytes(s.process.pid)) for s in mesh.services}
    raise SystemExit(0 if report(outcomes, loads, memory, args.window) else 1)


if __name__ == "__main__":
    main()

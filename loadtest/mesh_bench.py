"""The full mesh against the in-process engine: same workload, same model, same run.

N concurrent requests (random-token prompts, fixed output length, ignore_eos) are submitted at
once through the gateway of a mesh started by `kvmesh up`'s launcher, and through an in-process
Engine. Both sides are timed from submission: throughput = output tokens / time until the last
request finished; decode = the tokens that arrive once every request has its first, over the
time from then to the last; TTFT = time until a request's first token reached the client (the
engine's caller for in-process). Under that load TTFT is mostly queueing behind 64 prefills, so the
mesh's own cost is measured apart too: "added TTFT" is the idle TTFT difference, one request at
a time (`--idle-requests`), p50 over them. Each side runs `--rounds` times, alternating; the
best round counts. Run: make bench-mesh
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import time

import grpc

from kvmesh.engine import Engine
from kvmesh.mesh.compiled_steps import CompiledStepWatch
from kvmesh.mesh.gateways import default_tokenizers
from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest.engine_bench import make_prompts
from shared.config import CacheConfig, EngineConfig, parse_bytes
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from shared.runtime.heap import frozen_heap
from shared.sampling import SamplingParams


def summarize(ttfts: list[float], arrivals: list[tuple[float, int]], elapsed: float) -> dict:
    """arrivals: (seconds since the start, tokens) of every delta. Decode is what arrives once
    every request has its first token, over the time from then to the end."""
    ttfts = sorted(ttfts)
    tokens = sum(n for _, n in arrivals)
    all_started = ttfts[-1]
    decoded = sum(n for at, n in arrivals if at > all_started)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "decode_tok_s": decoded / (elapsed - all_started),
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] * 1e3,
    }


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def services_cpu(mesh: Mesh) -> dict[str, float]:
    """Every mesh process's CPU seconds so far, and this one's (the benchmark's client)."""
    return {s.name: cpu_seconds(s.process.pid) for s in mesh.services} | {
        "client": time.process_time()
    }


def run_in_process(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    first: dict[str, float] = {}
    arrivals: list[tuple[float, int]] = []
    while engine.has_unfinished():
        for output in engine.step():
            at = time.perf_counter() - started
            arrivals.append((at, len(output.new_token_ids)))
            first.setdefault(output.request_id, at)
    return summarize([first[i] for i in ids], arrivals, time.perf_counter() - started)


def idle_ttfts_in_process(engine: Engine, prompts: list[list[int]]) -> list[float]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttfts = []
    for prompt in prompts:
        started = time.perf_counter()
        engine.add_request(prompt, params)
        while not engine.step():
            pass
        ttfts.append(time.perf_counter() - started)
    return ttfts


async def idle_ttfts_mesh(mesh: Mesh, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """(TTFT, the worker's compute for that request's one step), both in seconds."""
    sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    samples = []
    async with (
        grpc.aio.insecure_channel(mesh.gateway_address) as channel,
        grpc.aio.insecure_channel(mesh.scheduler_addresses[0]) as scheduler_channel,
    ):
        stub = inference_pb2_grpc.InferenceStub(channel)
        scheduler = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
        for prompt in prompts:
            request = inference_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling
            )
            before = (await scheduler.GetLoad(scheduler_pb2.LoadRequest())).worker_compute_ms
            started = time.perf_counter()
            ttft = 0.0
            async for event in stub.Generate(request):
                if event.WhichOneof("event") == "delta" and not ttft:
                    ttft = time.perf_counter() - started
            after = (await scheduler.GetLoad(scheduler_pb2.LoadRequest())).worker_compute_ms
            samples.append((ttft, (after - before) / 1e3))
    return samples


CHANNELS_PER_GATEWAY = 8


def client_channels(address: str, gateways: int) -> list[grpc.aio.Channel]:
    """One channel for one gateway (its streams multiplexed on one connection); with several,
    8 a gateway, each its own connection (a channel is one, to the one gateway the kernel
    picked), as a pool of client processes would spread."""
    if gateways == 1:
        return [grpc.aio.insecure_channel(address)]
    own = [("grpc.use_local_subchannel_pool", 1)]  # else the channels share one connection
    count = CHANNELS_PER_GATEWAY * gateways
    return [grpc.aio.insecure_channel(address, options=own) for _ in range(count)]


async def run_mesh(
    address: str, prompts: list[list[int]], output_len: int, gateways: int = 1
) -> dict:
    sampling = common_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    channels = client_channels(address, gateways)
    stubs = [inference_pb2_grpc.InferenceStub(channel) for channel in channels]
    try:
        started = time.perf_counter()

        arrivals: list[tuple[float, int]] = []

        async def one(index: int, prompt: list[int]) -> float:
            request = inference_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling
            )
            ttft = 0.0
            async for event in stubs[index % len(stubs)].Generate(request):
                if event.WhichOneof("event") == "delta":
                    at = time.perf_counter() - started
                    arrivals.append((at, len(event.delta.token_ids)))
                    if event.delta.first_token:
                        ttft = at
                elif event.WhichOneof("event") == "failed":
                    raise RuntimeError(event.failed.error.message)
            return ttft

        ttfts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - started
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    return summarize(list(ttfts), arrivals, elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-requests", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--backend", default="torch", help="both sides' (cupy: on a GPU)")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the mesh scheduler's; 1 is every token"
    )
    parser.add_argument(
        "--plan-ahead", default="auto", choices=("auto", "on", "off"), help="the scheduler's"
    )
    parser.add_argument(
        "--gateways", type=int, default=1, help="gateway processes sharing the mesh's ports"
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    vocab = 49152
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, seed=0)
    warmup = make_prompts(4, 16, 32, vocab, seed=1)
    mesh_rounds, engine_rounds = [], []
    mesh_idle: list[float] = []
    hop_ms: list[float] = []
    engine_idle: list[float] = []
    worker_args = ["--kv-memory", args.kv_memory, "--backend", args.backend]
    config = MeshConfig(
        worker_threads=args.threads,
        gateways=args.gateways,
        tokenizers=default_tokenizers(args.gateways),
        worker_args=worker_args,
        scheduler_args=[
            "--stream-interval",
            str(args.stream_interval),
            "--plan-ahead",
            args.plan_ahead,
        ],
    )
    for round_index in range(args.rounds):
        # One side at a time: two torch pools on the same cores would slow both.
        with Mesh(config) as mesh:
            CompiledStepWatch(mesh.services).wait(timeout_s=1800)
            asyncio.run(run_mesh(mesh.gateway_address, warmup, 4))
            idle = make_prompts(args.idle_requests, 64, 64, vocab, seed=100 + round_index)
            samples = asyncio.run(idle_ttfts_mesh(mesh, idle))
            # One step per idle request: what is not the worker's compute is the mesh's cost.
            hop_ms += [(ttft - compute) * 1e3 for ttft, compute in samples]
            mesh_idle += [ttft for ttft, _ in samples]
            before = services_cpu(mesh)
            with frozen_heap():  # the client's collections out of the mesh's figures
                mesh_rounds.append(
                    asyncio.run(
                        run_mesh(mesh.gateway_address, prompts, args.output_len, args.gateways)
                    )
                )
            after = services_cpu(mesh)
            per_k = 1e3 / mesh_rounds[-1]["output_tokens"]
            mesh_rounds[-1]["cpu_ms_per_token"] = {
                name: (after[name] - before[name]) * per_k for name in before
            }
        cache = CacheConfig(kv_memory_bytes=parse_bytes(args.kv_memory))
        engine = Engine(EngineConfig(backend=args.backend, cache=cache))
        run_in_process(engine, warmup, 4)
        idle = make_prompts(args.idle_requests, 64, 64, vocab, seed=200 + round_index)
        engine_idle += idle_ttfts_in_process(engine, idle)
        with frozen_heap():  # as the worker service runs, its start-up heap frozen
            engine_rounds.append(run_in_process(engine, prompts, args.output_len))
        del engine
        gc.collect()
        print(
            f"round {round_index}: mesh {mesh_rounds[-1]['output_tok_s']:.1f} tok/s "
            f"(decode {mesh_rounds[-1]['decode_tok_s']:.1f}), in-process "
            f"{engine_rounds[-1]['output_tok_s']:.1f} "
            f"(decode {engine_rounds[-1]['decode_tok_s']:.1f})",
            flush=True,
        )
    mesh_best = max(mesh_rounds, key=lambda r: r["output_tok_s"])
    engine_best = max(engine_rounds, key=lambda r: r["output_tok_s"])
    print(
        f"\n{args.requests} concurrent requests, prompts {args.min_prompt}-{args.max_prompt} "
        f"tokens, {args.output_len} output tokens each, {args.threads} torch threads, "
        f"stream interval {args.stream_interval}"
    )
    print(f"{'':12}{'out tok/s':>11}{'decode tok/s':>14}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for name, result in (("mesh", mesh_best), ("in-process", engine_best)):
        print(
            f"{name:12}{result['output_tok_s']:>11.1f}{result['decode_tok_s']:>14.1f}"
            f"{result['ttft_p50_ms']:>13.1f}{result['ttft_p99_ms']:>13.1f}"
        )
    ratio = mesh_best["output_tok_s"] / engine_best["output_tok_s"]
    decode_ratio = mesh_best["decode_tok_s"] / engine_best["decode_tok_s"]
    busy = sorted(mesh_best["cpu_ms_per_token"].items(), key=lambda item: -item[1])
    print("mesh CPU ms per output token: " + ", ".join(f"{n} {ms:.3f}" for n, ms in busy))
    print(f"mesh / in-process: throughput {ratio:.3f}x, decode {decode_ratio:.3f}x (goal >= 0.9)")
    if mesh_idle:  # --idle-requests 0 leaves them out
        mesh_idle_ms = statistics.median(mesh_idle) * 1e3
        engine_idle_ms = statistics.median(engine_idle) * 1e3
        print(
            f"idle TTFT p50 ({len(mesh_idle)} single 64-token prompts): mesh "
            f"{mesh_idle_ms:.1f} ms, in-process {engine_idle_ms:.1f} ms, added "
            f"{mesh_idle_ms - engine_idle_ms:+.1f} ms (goal < 5)"
        )
        print(
            f"mesh overhead per idle request (client TTFT minus the worker's step compute): "
            f"p50 {statistics.median(hop_ms):.2f} ms, mean {statistics.mean(hop_ms):.2f} ms"
        )
    if args.json:
        with open(args.json, "w") as handle:
            figures = {"mesh": mesh_rounds, "in_process": engine_rounds}
            figures |= {"mesh_idle_ttft_s": mesh_idle, "in_process_idle_ttft_s": engine_idle}
            figures |= {"mesh_overhead_ms": hop_ms}
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()

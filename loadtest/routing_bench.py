"""Cache-aware routing against round-robin, in one run, on the default model.

Workload: 8 system prompts of ~1,000 tokens, each shared by many requests (system prompt plus
a short unique question, a few output tokens), sent in a seeded shuffled order by a fixed
number of concurrent clients. Each worker's KV pool holds about half the system prompts, as
in production where the cache is smaller than the working set: a router that scatters a
prompt over both workers makes each evict what the other also holds.

Three meshes, started one after the other with the same settings:
- cache-aware routing over 2 workers (the gateway's default);
- round-robin over 2 workers;
- one worker with both workers' KV memory and threads: the "one big server" whose prefix hit
  rate the two-worker mesh should come close to.

Per mesh: prefix hit rate (cached prompt tokens / prompt tokens, from the completed events),
TTFT p50/p99 at the client, throughput (requests and output tokens per second of wall time).
Run: make bench-routing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import grpc

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

VOCAB_LOW, VOCAB_HIGH = 100, 40_000  # ordinary tokens of SmolLM2's 49,152


@dataclass
class Workload:
    system_prompts: list[list[int]]
    requests: list[list[int]]
    output_len: int


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_tokens)]
        for _ in range(args.system_prompts)
    ]
    order = [i for i in range(args.system_prompts) for _ in range(args.requests_per_prompt)]
    rng.shuffle(order)
    requests = [
        systems[i] + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.question_tokens)]
        for i in order
    ]
    return Workload(systems, requests, args.output_len)


async def drive(address: str, workload: Workload, concurrency: int) -> dict:
    sampling = common_pb2.SamplingParams(
        max_tokens=workload.output_len, temperature=0.0, ignore_eos=True
    )
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in workload.requests:
        queue.put_nowait(prompt)
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = output_tokens = 0
    reasons: dict[str, int] = {}

    async def client(stub: inference_pb2_grpc.InferenceStub) -> None:
        nonlocal prompt_tokens, cached_tokens, output_tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            request = inference_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling
            )
            started = time.perf_counter()
            first = None
            async for event in stub.Generate(request, timeout=600):
                kind = event.WhichOneof("event")
                if kind == "accepted":
                    reason = event.accepted.routing.reason
                    reasons[reason] = reasons.get(reason, 0) + 1
                elif kind == "delta" and first is None:
                    first = time.perf_counter() - started
                elif kind == "completed":
                    usage = event.completed.usage
                    prompt_tokens += usage.prompt_tokens
                    cached_tokens += usage.cached_tokens
                    output_tokens += usage.completion_tokens
                elif kind in ("failed", "cancelled"):
                    raise RuntimeError(f"request ended {kind}: {event}")
            assert first is not None
            ttfts.append(first)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        started = time.perf_counter()
        await asyncio.gather(*(client(stub) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "hit_rate": cached_tokens / prompt_tokens,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] * 1e3,
        "req_s": len(ttfts) / elapsed,
        "output_tok_s": output_tokens / elapsed,
        "seconds": elapsed,
        "route_reasons": reasons,
    }


def run_mesh(name: str, config: MeshConfig, workload: Workload, concurrency: int) -> dict:
    started = time.perf_counter()
    with Mesh(config) as mesh:
        print(f"{name}: mesh up in {time.perf_counter() - started:.0f}s", flush=True)
        result = asyncio.run(drive(mesh.gateway_address, workload, concurrency))
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--requests-per-prompt", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--kv-memory-mib",
        type=int,
        default=192,
        help="per worker: about 4 of the 8 system prompts at fp32",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = make_workload(args)
    kv = args.kv_memory_mib

    def two_workers(routing: str) -> MeshConfig:
        return MeshConfig(
            workers=2,
            worker_threads=1,
            worker_args=["--kv-memory", f"{kv}MiB"],
            gateway_args=["--routing", routing],
        )

    single = MeshConfig(workers=1, worker_threads=2, worker_args=["--kv-memory", f"{2 * kv}MiB"])
    results = {
        "cache-aware": run_mesh(
            "cache-aware", two_workers("cache-aware"), workload, args.concurrency
        ),
        "round-robin": run_mesh(
            "round-robin", two_workers("round-robin"), workload, args.concurrency
        ),
        "single-worker": run_mesh("single-worker", single, workload, args.concurrency),
    }
    print(
        f"\n{len(workload.requests)} requests: {args.system_prompts} system prompts x "
        f"{args.requests_per_prompt}, {args.system_tokens}+{args.question_tokens} prompt tokens, "
        f"{args.output_len} output tokens, {args.concurrency} concurrent clients; "
        f"{kv} MiB KV per worker\n"
    )
    print("| mesh | prefix hit rate | TTFT p50 ms | TTFT p99 ms | req/s | output tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(
            f"| {name} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
            f"| {r['req_s']:.2f} | {r['output_tok_s']:.1f} |"
        )
    aware, robin = results["cache-aware"], results["round-robin"]
    p50_gain = robin["ttft_p50_ms"] / aware["ttft_p50_ms"]
    print(
        f"\ncache-aware vs round-robin: TTFT p50 {p50_gain:.2f}x "
        f"better, p99 {robin['ttft_p99_ms'] / aware['ttft_p99_ms']:.2f}x, throughput "
        f"{aware['req_s'] / robin['req_s']:.2f}x; hit rate {aware['hit_rate']:.1%} vs the "
        f"single worker's {results['single-worker']['hit_rate']:.1%}"
    )


if __name__ == "__main__":
    main()

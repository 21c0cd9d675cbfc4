"""What the OpenAI HTTP front costs next to gRPC: the same load through the same mesh, once as
gRPC Generate streams and once as `POST /v1/completions` with `stream: true` (server-sent
events), rounds alternating so drift on a noisy machine hits both sides alike.

Each round sends N concurrent requests (random-token prompts, fixed output length,
ignore_eos, greedy). Figures per side: output tokens/s, TTFT p50 as the client sees it, and the
gateway process's CPU seconds per round (psutil): the front's own work is there, since both
sides share every other process. The HTTP client is aiohttp reading raw SSE lines, as light as
the gRPC client, so the two clients cost the shared cores about the same.
Run: make bench-http
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp
import psutil

from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest.engine_bench import make_prompts
from loadtest.mesh_bench import run_mesh, summarize


async def run_http(base_url: str, prompts: list[list[int]], output_len: int) -> dict:
    body = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()

        async def one(prompt: list[int]) -> float:
            """TTFT: until the first chunk, which carries the first delta (as gRPC's does)."""
            ttft = 0.0
            async with session.post(
                f"{base_url}/completions", json={**body, "prompt": prompt}
            ) as r:
                r.raise_for_status()
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue  # blank separators and the final [DONE]
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    ttft = ttft or time.perf_counter() - started
            return ttft

        ttfts = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - started
    # ignore_eos: every request made exactly output_len tokens.
    return summarize(list(ttfts), len(prompts) * output_len, elapsed)


def gateway_cpu_s(mesh: Mesh) -> float:
    times = psutil.Process(mesh.service("gateway").process.pid).cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-memory", default="512MiB")
    args = parser.parse_args()

    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, 49152, seed=0)
    warmup = make_prompts(4, 16, 32, 49152, seed=1)
    config = MeshConfig(
        worker_threads=args.threads, worker_args=["--kv-memory", args.kv_memory], tracing=False
    )
    results: dict[str, list[dict]] = {"grpc": [], "http": []}
    cpu: dict[str, list[float]] = {"grpc": [], "http": []}
    with Mesh(config) as mesh:
        sides = {
            "grpc": lambda p, n: run_mesh(mesh.gateway_address, p, n),
            "http": lambda p, n: run_http(mesh.http_url, p, n),
        }
        for run in sides.values():  # unmeasured: the first run of new shapes is slower
            asyncio.run(run(warmup, 4))
        asyncio.run(run_mesh(mesh.gateway_address, prompts, args.output_len))
        for round_index in range(args.rounds):
            order = ("grpc", "http") if round_index % 2 == 0 else ("http", "grpc")
            for side in order:
                before = gateway_cpu_s(mesh)
                result = asyncio.run(sides[side](prompts, args.output_len))
                cpu[side].append(gateway_cpu_s(mesh) - before)
                results[side].append(result)
                print(
                    f"round {round_index} {side}: {result['output_tok_s']:.1f} tok/s, "
                    f"TTFT p50 {result['ttft_p50_ms']:.0f} ms, gateway CPU {cpu[side][-1]:.2f} s",
                    flush=True,
                )
    print(
        f"\n{args.requests} concurrent requests, prompts {args.min_prompt}-{args.max_prompt} "
        f"tokens, {args.output_len} output tokens, {args.rounds} rounds each side (medians)"
    )
    figures = {}
    for side in ("grpc", "http"):
        figures[side] = (
            statistics.median(r["output_tok_s"] for r in results[side]),
            statistics.median(r["ttft_p50_ms"] for r in results[side]),
            statistics.median(cpu[side]),
        )
        tok_s, ttft, cpu_s = figures[side]
        print(f"{side}: {tok_s:.1f} tok/s, TTFT p50 {ttft:.0f} ms, gateway CPU {cpu_s:.2f} s/round")
    (g_tok, g_ttft, g_cpu), (h_tok, h_ttft, h_cpu) = figures["grpc"], figures["http"]
    print(
        f"http / grpc: throughput {h_tok / g_tok:.3f}x, TTFT p50 {h_ttft / g_ttft:.3f}x, "
        f"gateway CPU {h_cpu / g_cpu:.3f}x "
        f"({(h_cpu - g_cpu) / (args.requests * args.output_len) * 1e6:+.0f} µs per token)"
    )


if __name__ == "__main__":
    main()

"""How many streamed tokens a second the mesh itself can carry: the serving path on the
simulated backend (`--backend sim`), whose steps take a set time and compute nothing, so every
CPU second the services spend is the price of carrying tokens, not of making them.

For each count of concurrent streams (`--streams`, 32,128,256) and each protocol (gRPC
`Generate` streams and `POST /v1/completions` with SSE), one round: every stream is opened at
once with a random-token prompt and decodes `--output-len` tokens (ignore_eos), delivered every
`--stream-interval` tokens. Per round: streamed tok/s at the client; each process's CPU
microseconds per streamed token (/proc, the client apart); the inter-token latency at the
client, p50 and p99, against the simulated step; and the tok/s each process's stage would carry
on one core of its own (1e6 / its µs per token), whose least is the mesh's ceiling here.
Run: make bench-mesh-ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import aiohttp

from kvmesh.mesh.gateways import default_tokenizers, stage_of
from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest.engine_bench import make_prompts
from loadtest.mesh_bench import client_channels, services_cpu
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from shared.runtime.heap import frozen_heap

STAGES = ("gateway", "tokenizer", "scheduler")  # the serving path's per-token stages
VOCAB = 49152  # the default model's: prompts of random ids below it


@dataclass
class Arrivals:
    """What the client saw of one round: every delta's time and token count, per stream."""

    started: float = field(default_factory=time.perf_counter)
    streams: list[list[tuple[float, int]]] = field(default_factory=list)

    def stream(self) -> list[tuple[float, int]]:
        self.streams.append([])
        return self.streams[-1]


async def grpc_round(mesh: Mesh, prompts: list[list[int]], output_len: int) -> Arrivals:
    sampling = common_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    arrivals = Arrivals()
    channels = client_channels(mesh.gateway_address, len(mesh.gateways))
    stubs = [inference_pb2_grpc.InferenceStub(channel) for channel in channels]

    async def one(index: int, prompt: list[int]) -> None:
        seen = arrivals.stream()
        ids = common_pb2.TokenIds(ids=prompt)
        async for event in stubs[index % len(stubs)].Generate(
            inference_pb2.GenerateRequest(token_ids=ids, sampling=sampling)
        ):
            if event.HasField("delta"):
                seen.append((time.perf_counter(), len(event.delta.token_ids)))

    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    return arrivals


async def http_round(mesh: Mesh, prompts: list[list[int]], output_len: int) -> Arrivals:
    """Raw SSE lines, each chunk a delta; their tokens from the usage the stream ends with."""
    body = {
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals = Arrivals()
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(prompt: list[int]) -> None:
            seen = arrivals.stream()
            url = f"{mesh.http_url}/completions"
            async with session.post(url, json={**body, "prompt": prompt}) as response:
                response.raise_for_status()
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue  # blank separators and the final [DONE]
                    if b'"completion_tokens"' in line:  # the last chunk: usage alone
                        _spread(seen, int(json.loads(line[6:])["usage"]["completion_tokens"]))
                    else:
                        seen.append((time.perf_counter(), 1))

        await asyncio.gather(*(one(p) for p in prompts))
    return arrivals


def _spread(seen: list[tuple[float, int]], tokens: int) -> None:
    """The stream's token count over its chunks (one each at stream interval 1)."""
    if not seen:
        return
    each, extra = divmod(tokens, len(seen))
    seen[:] = [(at, each + (i < extra)) for i, (at, _) in enumerate(seen)]


def carried_tokens(mesh: Mesh) -> dict[str, float]:
    """Each gateway's streamed tokens so far (kvmesh_generation_tokens_total)."""
    carried = {}
    for gateway in mesh.gateways:
        with urllib.request.urlopen(gateway.metrics_url or "", timeout=5) as page:
            for line in page.read().decode().splitlines():
                if line.startswith("kvmesh_generation_tokens_total "):
                    carried[gateway.name] = float(line.split()[1])
    return carried


def stage_ceilings(cpu: dict[str, float], carried: dict[str, float], tokens: int) -> dict:
    """Each process's tok/s on a core of its own (the tokens it carried over its CPU seconds;
    a stage's processes that count none split the tokens evenly), and each stage's sum."""
    by_process: dict[str, float] = {}
    for name, seconds in cpu.items():
        stage = stage_of(name)
        peers = sum(1 for other in cpu if stage_of(other) == stage)
        share = carried.get(name, tokens / peers)
        if name != "client" and seconds > 0:
            by_process[name] = share / seconds
    by_stage: dict[str, float] = {}
    for name, ceiling in by_process.items():
        by_stage[stage_of(name)] = by_stage.get(stage_of(name), 0.0) + ceiling
    return {"process": by_process, "stage": by_stage}


def summarize(
    arrivals: Arrivals, cpu: dict[str, float], carried: dict[str, float], step_ms: float
) -> dict:
    ended = max(at for stream in arrivals.streams for at, _ in stream)
    tokens = sum(n for stream in arrivals.streams for _, n in stream)
    gaps = sorted(
        (later - earlier) * 1e3
        for stream in arrivals.streams
        for (earlier, _), (later, _) in itertools.pairwise(stream)
    )
    us_per_token = {name: seconds * 1e6 / tokens for name, seconds in cpu.items()}
    path = sum(us for name, us in us_per_token.items() if stage_of(name) in STAGES)
    ceilings = stage_ceilings(cpu, carried, tokens)
    return {
        "streamed_tokens": tokens,
        # Above 1 where a relay fell behind and its lane merged a step's tokens into the next.
        "tokens_per_delta": tokens / sum(len(stream) for stream in arrivals.streams),
        "streamed_tok_s": tokens / (ended - arrivals.started),
        "cpu_us_per_token": us_per_token,
        "serving_path_us_per_token": path,
        "itl_p50_ms": statistics.median(gaps),
        "itl_p99_ms": gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))],
        "itl_p99_over_step": gaps[round(0.99 * (len(gaps) - 1))] / step_ms if step_ms else None,
        "ceiling_tok_s_per_core": ceilings["process"],
        "stage_ceiling_tok_s": ceilings["stage"],
        "gateway_tokens": carried,
    }


Round = Callable[[Mesh, list[list[int]], int], Coroutine[None, None, Arrivals]]


def measure(
    mesh: Mesh, run: Round, prompts: list[list[int]], output_len: int, step_ms: float
) -> dict:
    before, carried_before = services_cpu(mesh), carried_tokens(mesh)
    with frozen_heap():  # no full collection of the client's heap mid-round
        arrivals = asyncio.run(run(mesh, prompts, output_len))
    after, carried_after = services_cpu(mesh), carried_tokens(mesh)
    cpu = {name: after[name] - before[name] for name in after}
    carried = {name: carried_after[name] - carried_before[name] for name in carried_after}
    return summarize(arrivals, cpu, carried, step_ms)


def report(row: dict) -> str:
    us = row["cpu_us_per_token"]
    stages = ", ".join(f"{n} {us[n]:.0f}" for n in sorted(us, key=lambda n: -us[n]))
    ceilings = {n: c for n, c in row["stage_ceiling_tok_s"].items() if n in STAGES}
    least = min(ceilings.items(), key=lambda item: item[1], default=("none", 0.0))
    gateways = [c for n, c in row["ceiling_tok_s_per_core"].items() if stage_of(n) == "gateway"]
    each = ", ".join(f"{c:.0f}" for c in gateways)
    return (
        f"{row['protocol']:>4} {row['streams']:>4} streams: {row['streamed_tok_s']:8.0f} tok/s "
        f"({row['tokens_per_delta']:.1f} a delta); "
        f"gateway+tokenizer+scheduler {row['serving_path_us_per_token']:.0f} µs/token "
        f"(CPU µs per token: {stages}); ITL p50 {row['itl_p50_ms']:.2f} ms, p99 "
        f"{row['itl_p99_ms']:.2f} ms; gateway stage ceiling {ceilings.get('gateway', 0):.0f} tok/s "
        f"({each} a gateway); least stage: {least[0]} {least[1]:.0f} tok/s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="32,128,256")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=2.0, help="the simulated step")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--plan-ahead", default="on", choices=("on", "off"))
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes (shared ports)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds each; the median shown")
    parser.add_argument("--json", help="write every round here too")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.streams.split(",")]
    config = MeshConfig(
        worker_args=["--backend", "sim", "--sim-step-ms", str(args.step_ms)],
        scheduler_args=[
            *("--max-num-seqs", str(max(counts)), "--plan-ahead", args.plan_ahead),
            *("--stream-interval", str(args.stream_interval)),
        ],
        gateways=args.gateways,
        tokenizers=default_tokenizers(args.gateways),
        tracing=False,
    )
    rows = []
    with Mesh(config) as mesh:
        rounds: dict[str, Round] = {"grpc": grpc_round, "http": http_round}
        for streams in counts:
            prompts = make_prompts(streams, args.prompt_len, args.prompt_len, VOCAB, streams)
            for protocol in args.protocols.split(","):
                run = rounds[protocol]
                tries = [
                    measure(mesh, run, prompts, args.output_len, args.step_ms)
                    for _ in range(args.repeat)
                ]
                tries.sort(key=lambda row: row["serving_path_us_per_token"])
                row = tries[len(tries) // 2]  # the median round: 2 vCPUs vary 20% round to round
                rows.append({"protocol": protocol, "streams": streams, **row})
                print(report(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

"""What tracing costs: the same load through a mesh with tracing on and one with it off, in
one run, rounds alternating so drift on a noisy machine hits both sides alike.

Both meshes are up at once (an idle mesh costs next to nothing); each round sends N concurrent
requests (random-token prompts, fixed output length, ignore_eos) to one of them. Throughput =
output tokens / time until the last request finished. On two shared cores a round's throughput
swings by more than tracing could cost, so the CPU seconds every process of the mesh used in
the round (psutil) are measured too: tracing's cost is the CPU it adds, per service, and the
share of the whole mesh's CPU that is. Spans dropped are read from the gateway's metrics.
Run: make bench-tracing
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import urllib.request

import psutil

from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest.engine_bench import make_prompts
from loadtest.mesh_bench import run_mesh


def spans_dropped(mesh: Mesh) -> float:
    url = mesh.service("gateway").metrics_url or ""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[-1])
        for line in text.splitlines()
        if line.startswith("kvmesh_spans_dropped_total{")
    )


def cpu_seconds(mesh: Mesh) -> dict[str, float]:
    """CPU time (user + system) each process of the mesh has used so far."""
    used = {}
    for service in mesh.services:
        times = psutil.Process(service.process.pid).cpu_times()
        used[service.name] = times.user + times.system
    return used


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
    worker_args = ["--kv-memory", args.kv_memory]
    results: dict[bool, list[dict]] = {True: [], False: []}
    cpu: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with (
        Mesh(MeshConfig(worker_threads=args.threads, worker_args=worker_args)) as traced,
        Mesh(
            MeshConfig(worker_threads=args.threads, worker_args=worker_args, tracing=False)
        ) as untraced,
    ):
        meshes = {True: traced, False: untraced}
        for mesh in meshes.values():  # unmeasured: the first run of new shapes is slower
            asyncio.run(run_mesh(mesh.gateway_address, warmup, 4))
            asyncio.run(run_mesh(mesh.gateway_address, prompts, args.output_len))
        for round_index in range(args.rounds):
            order = (True, False) if round_index % 2 == 0 else (False, True)
            for tracing in order:
                before = cpu_seconds(meshes[tracing])
                result = asyncio.run(
                    run_mesh(meshes[tracing].gateway_address, prompts, args.output_len)
                )
                after = cpu_seconds(meshes[tracing])
                results[tracing].append(result)
                cpu[tracing].append({name: after[name] - before[name] for name in after})
                print(
                    f"round {round_index} tracing {'on ' if tracing else 'off'}: "
                    f"{result['output_tok_s']:.1f} tok/s, TTFT p50 {result['ttft_p50_ms']:.0f} ms",
                    flush=True,
                )
        dropped = spans_dropped(traced)
    on = statistics.median(r["output_tok_s"] for r in results[True])
    off = statistics.median(r["output_tok_s"] for r in results[False])
    best_on = max(r["output_tok_s"] for r in results[True])
    best_off = max(r["output_tok_s"] for r in results[False])
    print(
        f"\n{args.requests} concurrent requests, prompts {args.min_prompt}-{args.max_prompt} "
        f"tokens, {args.output_len} output tokens, {args.rounds} rounds each side"
    )
    print(f"tracing on : median {on:.1f} tok/s, best {best_on:.1f}")
    print(f"tracing off: median {off:.1f} tok/s, best {best_off:.1f}")
    print(
        f"throughput cost of tracing: median {(1 - on / off) * 100:+.1f}%, "
        f"best {(1 - best_on / best_off) * 100:+.1f}%; spans dropped {dropped:.0f}"
    )
    print("\nCPU seconds per round (median), tracing off -> on:")
    added = total_off = 0.0
    for name in cpu[True][0]:
        on_s = statistics.median(round_cpu[name] for round_cpu in cpu[True])
        off_s = statistics.median(round_cpu.get(name, 0.0) for round_cpu in cpu[False])
        total_off += off_s
        if not name.startswith("engine-worker"):
            added += on_s - off_s
        print(f"  {name:<16}{off_s:8.2f} -> {on_s:8.2f}  ({on_s - off_s:+.2f})")
    # The engine-worker's OpenMP threads spin while it waits, so its CPU follows its wall time
    # (the noise above); the spans' own work is in the other processes.
    print(
        f"CPU tracing adds outside the engine-worker: {added:+.2f} s per round, "
        f"{added / total_off * 100:+.2f}% of the mesh's CPU (goal < 3%)"
    )


if __name__ == "__main__":
    main()

"""Prefill/decode split against mixed pairs, on the default model (one run, this machine):

two engine-workers, each pinned to a core of its own (`taskset`), one prefill pair and one
decode pair against two mixed pairs, under the same load: a steady set of decoding streams
(short prompts, long answers, each started again when it ends) while 3,000-token prompts keep
arriving (each its own text: no prefix-cache hit). Printed side by side: the decoding streams'
inter-token latency p50/p99, the long prompts' TTFT p50/p99, output tok/s, and what the
handovers moved. Run: make bench-pd
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest.kv_tiers_bench import document
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc


@dataclass
class Observed:
    gaps: list[float] = field(default_factory=list)  # decoding streams' inter-token seconds
    long_ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0


def request(ids: list[int], max_tokens: int) -> inference_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return inference_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling)


async def one(
    stub: inference_pb2_grpc.InferenceStub,
    ids: list[int],
    max_tokens: int,
    observed: Observed,
    stream: bool,
    until: float,
) -> None:
    started = last = time.perf_counter()
    first = True
    async for event in stub.Generate(request(ids, max_tokens), timeout=600):
        if event.HasField("delta") and event.delta.token_ids:
            now = time.perf_counter()
            if now < until:  # only what the measured window saw
                observed.tokens += len(event.delta.token_ids)
                if first and not stream:
                    observed.long_ttfts.append(now - started)
                elif not first and stream:
                    observed.gaps.append(now - last)
            first, last = False, now
        elif event.HasField("failed") or event.HasField("cancelled"):
            observed.failed += 1


async def streams(stub, prompt: list[int], args, observed: Observed, until: float) -> None:  # type: ignore[no-untyped-def]
    while time.perf_counter() < until:
        await one(stub, prompt, args.stream_tokens, observed, True, until)


async def drive(address: str, args: argparse.Namespace, texts: list[list[int]]) -> Observed:
    observed = Observed()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        # Warm both pairs' first steps (and the prepared artifact) before the window opens.
        await asyncio.gather(*(one(stub, texts[0][:64], 4, Observed(), True, 0) for _ in range(4)))
        until = time.perf_counter() + args.seconds
        shorts = [texts[0][i * 40 : i * 40 + 32] for i in range(args.streams)]
        tasks = [asyncio.create_task(streams(stub, s, args, observed, until)) for s in shorts]
        longs = []
        for index in range(1, len(texts)):
            if time.perf_counter() >= until - args.long_every_s / 2:
                break
            longs.append(asyncio.create_task(one(stub, texts[index], 16, observed, False, until)))
            await asyncio.sleep(args.long_every_s)
        await asyncio.gather(*tasks, *longs)
    return observed


def handover_figures(mesh: Mesh) -> str:
    """What the decode worker's pulls moved, from its Prometheus endpoint."""
    url = mesh.service("engine-worker-1").metrics_url or ""
    with urllib.request.urlopen(url, timeout=5) as reply:
        samples = {
            (sample.name, sample.labels.get("direction", "")): sample.value
            for family in text_string_to_metric_families(reply.read().decode())
            for sample in family.samples
        }
    count = samples.get(("kvmesh_kv_handover_seconds_count", ""), 0)
    if not count:
        return "no handover"
    seconds = samples[("kvmesh_kv_handover_seconds_sum", "")] / count
    megabytes = samples[("kvmesh_kv_handover_bytes_total", "received")] / count / 1e6
    return f"{count:.0f} handovers, {megabytes:.1f} MB and {seconds * 1e3:.0f} ms each"


def run(split: bool, args: argparse.Namespace, texts: list[list[int]], folder: Path) -> dict:
    config = MeshConfig(
        workers=2,
        prefill_workers=1 if split else 0,
        decode_workers=1 if split else 0,
        worker_threads=1,
        worker_cpus=["0", "1"],
        worker_args=["--kv-memory", "1GiB"],
        log_dir=str(folder / ("split" if split else "mixed")),
        http_port=None,
        tracing=False,
    )
    with Mesh(config) as mesh:
        observed = asyncio.run(drive(mesh.gateway_address, args, texts))
        moved = handover_figures(mesh) if split else ""
    gaps, ttfts = sorted(observed.gaps), sorted(observed.long_ttfts)
    return {
        "itl_p50": statistics.median(gaps) * 1e3,
        "itl_p99": gaps[int(0.99 * (len(gaps) - 1))] * 1e3,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[int(0.99 * (len(ttfts) - 1))],
        "tok_s": observed.tokens / args.seconds,
        "longs": len(ttfts),
        "failed": observed.failed,
        "moved": moved,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="the measured window")
    parser.add_argument("--streams", type=int, default=8, help="steady decoding streams")
    parser.add_argument("--stream-tokens", type=int, default=128, help="each stream's answer")
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--long-every-s", type=float, default=14.0)
    args = parser.parse_args()
    count = int(args.seconds / args.long_every_s) + 2
    base = document(args.long_tokens)
    # Each long prompt its own: the same text rotated, so no two share a first block.
    texts = [base[i * 97 % len(base) :] + base[: i * 97 % len(base)] for i in range(count)]
    with tempfile.TemporaryDirectory() as scratch:
        mixed = run(False, args, texts, Path(scratch))
        split = run(True, args, texts, Path(scratch))
    print(f"{args.streams} decoding streams, a {args.long_tokens}-token prompt every "
          f"{args.long_every_s:.0f} s, {args.seconds:.0f} s; two workers, a core each")  # fmt: skip
    print("| | two mixed pairs | prefill + decode pair | split against mixed |")
    print("| --- | --- | --- | --- |")
    for key, label, unit, lower_better in (
        ("itl_p50", "decoding ITL p50", "ms", True),
        ("itl_p99", "decoding ITL p99", "ms", True),
        ("ttft_p50", "long prompt TTFT p50", "s", True),
        ("ttft_p99", "long prompt TTFT p99", "s", True),
        ("tok_s", "output tok/s", "", False),
    ):
        a, b = mixed[key], split[key]
        better = b < a if lower_better else b > a
        ratio = max(a, b) / min(a, b)
        word = ("lower" if lower_better else "higher") if better else "worse"
        print(f"| {label} | {a:.2f} {unit} | {b:.2f} {unit} | {ratio:.2f}x {word} |")
    print(f"long prompts served: {mixed['longs']} / {split['longs']}; failed requests: "
          f"{mixed['failed']} / {split['failed']}; handovers: {split['moved']}")  # fmt: skip


if __name__ == "__main__":
    main()

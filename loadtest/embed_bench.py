"""Embeddings: kvmesh's encoder against sentence-transformers, and the mesh's batching against
one input per forward pass, each pair measured in the same run on the same texts.

1. In process, same torch threads: texts/s of `SentenceEncoder` (tokenize + forward) and of
   `SentenceTransformer.encode` at the same batch size, rounds alternating.
2. Through the mesh (gateway -> embedding worker): N single-text Embed calls, C at a time,
   once with the batcher on and once with `--max-embed-batch-tokens 1` (a forward pass per
   input): texts/s and p50/p99 latency per call.
Run: make bench-embed
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import grpc
import torch

from kvmesh.mesh.launcher import DEFAULT_EMBEDDER, Mesh, MeshConfig
from services.engine_worker.embed.encoder import SentenceEncoder
from shared.model_paths import default_embedding_model_path
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

WORDS = [
    "the",
    "a",
    "mesh",
    "token",
    "stream",
    "cache",
    "block",
    "gateway",
    "worker",
    "model",
    "latency",
    "batch",
    "prefix",
    "queue",
    "schedule",
    "request",
    "vector",
    "cosine",
    "sentence",
    "embedding",
    "search",
    "index",
    "query",
    "document",
    "answer",
]


def make_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 48))) for _ in range(count)]


def in_process(texts: list[str], batch: int, rounds: int) -> dict[str, float]:
    from sentence_transformers import SentenceTransformer

    path = default_embedding_model_path()
    ours = SentenceEncoder(path)
    peer = SentenceTransformer(path, device="cpu")

    def kvmesh_once() -> None:  # both sort by length, then run passes of `batch`
        ours.embed_sorted(ours.encode_texts(texts), chunk=batch)

    def peer_once() -> None:
        peer.encode(texts, batch_size=batch)

    kvmesh_once(), peer_once()  # warm both
    timings: dict[str, list[float]] = {"kvmesh": [], "sentence-transformers": []}
    for _ in range(rounds):
        for name, run in (("kvmesh", kvmesh_once), ("sentence-transformers", peer_once)):
            started = time.perf_counter()
            run()
            timings[name].append(time.perf_counter() - started)
    return {name: len(texts) / statistics.median(times) for name, times in timings.items()}


async def through_mesh(address: str, texts: list[str], concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        gate = asyncio.Semaphore(concurrency)

        async def one(text: str) -> None:
            request = inference_pb2.EmbedRequest(
                model=DEFAULT_EMBEDDER, inputs=[common_pb2.EmbedInput(text=text)]
            )
            async with gate:
                started = time.perf_counter()
                await stub.Embed(request, timeout=300)
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(one(t) for t in texts[:concurrency]))  # warm
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "texts_per_s": len(texts) / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
    }


def mesh_run(texts: list[str], concurrency: int, threads: int, embedder_args: list[str]) -> dict:
    config = MeshConfig(
        embedder="default",
        worker_threads=threads,
        worker_args=["--kv-memory", "64MiB"],
        embedder_args=embedder_args,
        http_port=None,
        tracing=False,
    )
    with Mesh(config) as mesh:
        return asyncio.run(through_mesh(mesh.gateway_address, texts, concurrency))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = make_texts(args.texts)
    rates = in_process(texts, args.batch, args.rounds)
    print(f"in process, {args.texts} texts, batch {args.batch}, {args.threads} threads:")
    for name, rate in rates.items():
        print(f"  {name:22} {rate:8.1f} texts/s")
    ratio = rates["kvmesh"] / rates["sentence-transformers"]
    print(f"  kvmesh / sentence-transformers: {ratio:.2f}x")
    batched = mesh_run(texts, args.concurrency, args.threads, [])
    single = mesh_run(texts, args.concurrency, args.threads, ["--max-embed-batch-tokens", "1"])
    print(f"through the mesh, {args.texts} single-text Embed calls, {args.concurrency} at a time:")
    for name, figures in (("batched", batched), ("one per pass", single)):
        print(
            f"  {name:14} {figures['texts_per_s']:8.1f} texts/s  p50 {figures['p50_ms']:7.1f} ms"
            f"  p99 {figures['p99_ms']:7.1f} ms"
        )
    print(f"  batched / one per pass: {batched['texts_per_s'] / single['texts_per_s']:.2f}x")


if __name__ == "__main__":
    main()

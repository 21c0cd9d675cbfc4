"""KV tiers against recomputing, on the default model (one run, this machine):

1. across workers: a two-worker mesh (round-robin routing), a 3,000-token document with one
   question served by one worker, the same document with another question by the other: the
   second request's TTFT with the Redis tier against a mesh without tiers;
2. across a restart: one worker serves the document, is SIGKILLed and restarted, then serves
   it with another question: TTFT with the disk tier against without;
3. under eviction pressure (in process): 32 multi-turn conversations cycling through a pool
   that holds about 4 of them: TTFT p50/p99 and prompt tokens computed, disk tier
   (write-back) against none.
4. where the line is (in process): TTFT of a prompt whose first N tokens load from the disk
   tier against the same length computed, N from 16 to 512, and what a loaded token costs
   against a computed one: what `--kv-load-min-tokens` should be on this machine.
The loaded answers' greedy tokens and logprobs are compared with the same request computed
without tiers. Run: make bench-kv-tiers
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from kvmesh.engine import Engine
from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.config import CacheConfig, EngineConfig, KVTierConfig
from shared.model_paths import default_model_path
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from shared.sampling import SamplingParams
from shared.text_tokenizer import load_tokenizer

TEXT = Path(__file__).with_name("texts") / "lighthouse.txt"
QUESTIONS = ["What is the keeper's name?", "Summarize the story in one line."]


def document(tokens: int) -> list[int]:
    tokenizer = load_tokenizer(default_model_path())
    assert tokenizer is not None
    text, ids = TEXT.read_text(), []
    part = 0
    while len(ids) < tokens:
        part += 1
        ids += tokenizer.encode(f"\n\nPart {part}.\n{text}")
    return ids[:tokens]


def question(index: int) -> list[int]:
    tokenizer = load_tokenizer(default_model_path())
    assert tokenizer is not None
    return tokenizer.encode(f"\n\nQuestion: {QUESTIONS[index]}\nAnswer:")


async def timed_generate(address: str, ids: list[int]) -> dict:
    """TTFT (client side, to the first delta), the answer and the completed event's timings."""
    request = inference_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1
        ),
    )
    started, ttft, answer = time.perf_counter(), None, []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        async for event in stub.Generate(request, timeout=600):
            if event.HasField("delta"):
                ttft = ttft or time.perf_counter() - started
                answer += [(lp.token_id, lp.logprob) for lp in event.delta.logprobs]
            elif event.HasField("completed"):
                completed = event.completed
            elif event.HasField("failed") or event.HasField("cancelled"):
                raise RuntimeError(str(event))
    return {"ttft": ttft, "answer": answer, "loaded": completed.timings.loaded_tokens,
            "worker": completed.execution.scheduler}  # fmt: skip


def mesh(workers: int, tiers: str, folder: Path) -> Mesh:
    args = ["--kv-memory", "512MiB", "--kv-load-min-tokens", "256"]
    args += ["--kv-tiers", tiers, "--kv-disk-dir", str(folder / "kv")] if tiers else []
    return Mesh(
        MeshConfig(
            workers=workers,
            worker_args=args,
            gateway_args=["--routing", "round-robin"],
            log_dir=str(folder / "logs"),
            http_port=None,
            tracing=False,
        )
    )


async def across_workers(doc: list[int], tiers: str, folder: Path) -> dict:
    with mesh(2, tiers, folder) as running:
        first = await timed_generate(running.gateway_address, doc + question(0))
        await asyncio.sleep(1.0)  # the write-through queue drains off the step path
        second = await timed_generate(running.gateway_address, doc + question(1))
    assert first["worker"] != second["worker"], "round robin sent both to one worker"
    return second


async def across_restart(doc: list[int], tiers: str, folder: Path) -> dict:
    with mesh(1, tiers, folder) as running:
        await timed_generate(running.gateway_address, doc + question(0))
        await asyncio.sleep(1.0)
        running.restart("engine-worker-0")
        deadline = time.monotonic() + 300
        while True:  # until the scheduler has reattached to the restarted worker
            try:
                return await timed_generate(running.gateway_address, doc + question(1))
            except RuntimeError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)


def conversations(engine: Engine, count: int, turns: int, doc: list[int]) -> dict:
    """`count` conversations, each its own slice of the document as context, a turn each in
    round robin; TTFT of every turn after the first, and prompt tokens computed."""
    histories = [doc[i * 37 % 900 : i * 37 % 900 + 480] for i in range(count)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ttfts, computed = [], 0
    for turn in range(turns):
        for history in histories:
            history += question(turn % 2)
            engine.add_request(list(history), params)
            started, first = time.perf_counter(), None
            while engine.has_unfinished():
                for output in engine.step():
                    if output.new_token_ids and first is None:
                        first = time.perf_counter() - started
                    history += output.new_token_ids
                    if output.finished:
                        computed += len(history) - 16 - output.num_cached_tokens
                        computed -= output.num_loaded_tokens
            if turn:
                ttfts.append(first)
    ttfts.sort()
    return {"p50": statistics.median(ttfts), "p99": ttfts[int(0.99 * (len(ttfts) - 1))],
            "computed": computed}  # fmt: skip


def first_token_s(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of a lone request, and its prompt tokens loaded."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        for output in engine.step():
            loaded = output.num_loaded_tokens
    return time.perf_counter() - started, loaded


def break_even(doc: list[int], folder: Path) -> None:
    tiers = KVTierConfig(tiers=("disk",), disk_dir=str(folder / "line"), load_min_tokens=16)
    config = EngineConfig(cache=CacheConfig(kv_memory_bytes=256 << 20), kv_tiers=tiers)
    writer, reader = Engine(config), Engine(config)
    ask = question(0)
    for size in (16, 32, 64, 128, 256, 512):
        stored, fresh = doc[:size], doc[1000 : 1000 + size]  # each never seen by the reader
        first_token_s(writer, stored + ask)
        assert writer.worker.kv_transfer.store is not None
        writer.worker.kv_transfer.store.flush()
        computed = min(first_token_s(reader, fresh + ask)[0] for _ in range(1))
        loaded, count = first_token_s(reader, stored + question(1))
        print(f"the line: {size:4d}-token prefix: TTFT {computed * 1e3:.0f} ms computed, "
              f"{loaded * 1e3:.0f} ms with {count} tokens loaded from disk "
              f"({computed / loaded:.2f}x)", flush=True)  # fmt: skip
        doc = doc[size:] + doc[:size]  # the next size starts on tokens the reader never saw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--only-line", action="store_true", help="part 4 alone")
    args = parser.parse_args()
    doc = document(max(args.doc_tokens, 2000))
    if args.only_line:
        with tempfile.TemporaryDirectory() as scratch:
            break_even(doc, Path(scratch))
        return
    doc = doc[: args.doc_tokens]
    rows: list[tuple[str, float, float, str]] = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for name, run, tiers in (("across workers", across_workers, "redis"),
                                 ("across a restart", across_restart, "disk")):  # fmt: skip
            off = asyncio.run(run(doc, "", folder / f"{tiers}-off"))
            on = asyncio.run(run(doc, tiers, folder / f"{tiers}-on"))
            same = "bit-identical" if on["answer"] == off["answer"] else "DIFFERENT"
            print(f"{name}: TTFT {off['ttft']:.2f} s computed, {on['ttft']:.2f} s with the "
                  f"{tiers} tier ({on['loaded']} tokens loaded): {off['ttft'] / on['ttft']:.1f}x "
                  f"lower; answer {same}", flush=True)  # fmt: skip
            rows.append((name, off["ttft"], on["ttft"], same))
        pool = 4 * 560 * 23 * 1024  # ~4 conversations of ~560 tokens, float16 K/V
        for tiers in ((), ("disk",)):
            config = EngineConfig(
                cache=CacheConfig(kv_memory_bytes=pool),
                kv_tiers=KVTierConfig(
                    tiers=tiers,
                    disk_dir=str(folder / "pressure"),
                    write="back",
                    load_min_tokens=256,
                ),
            )
            figures = conversations(Engine(config), args.conversations, args.turns, doc)
            label = "+".join(tiers) or "none"
            print(f"eviction pressure, tiers {label}: TTFT p50 {figures['p50'] * 1e3:.0f} ms, "
                  f"p99 {figures['p99'] * 1e3:.0f} ms, prompt tokens computed "
                  f"{figures['computed']}", flush=True)  # fmt: skip
        break_even(document(2000), folder)


if __name__ == "__main__":
    main()

"""A tenant flooding with large n, the gateway's watermarks on: tenant A sends a request of
n = 16 every `--a-interval` s (far more sequences than the batch holds, so every scheduler is
soon past the queue watermark), tenant B sends a light, steady load. Printed: B's TTFT alone and
beside A's flood, with how many of B's requests were admitted, and how A's requests ended
(A past its fair share is refused RATE_LIMITED; B, below its share, is admitted).
Goal: every B request admitted, B's TTFT p99 beside the flood within 2x of alone.
Run: make bench-tenant-flood
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import tempfile

import grpc

from kvmesh.mesh.launcher import Mesh
from loadtest.fairness_bench import TABLE_HEAD, row, steady, two_tenant_config
from loadtest.overload_bench import percentile
from shared import grpc_errors
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc


async def wide(stub: inference_pb2_grpc.InferenceStub, args: argparse.Namespace) -> str:
    """One request of n = 16 long completions, read to its end (or cancelled): how it ended."""
    request = inference_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[11, 12, 13, 14]),
        sampling=common_pb2.SamplingParams(max_tokens=args.a_tokens, ignore_eos=True),
        n=16,
    )
    try:
        async for _event in stub.Generate(request, metadata=(("x-api-key", "sk-a"),)):
            pass
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED:
            return "still running at the end"
        return grpc_errors.from_rpc_error(error).reason.value
    return "completed"


async def flood(
    stub: inference_pb2_grpc.InferenceStub, args: argparse.Namespace, stop: asyncio.Event
) -> collections.Counter[str]:
    """A request of n = 16 every `--a-interval` s until `stop`: how each ended."""
    sent: list[asyncio.Task[str]] = []
    while not stop.is_set():
        sent.append(asyncio.create_task(wide(stub, args)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.a_interval)
    for task in sent:
        task.cancel()
    ended = await asyncio.gather(*sent, return_exceptions=True)
    return collections.Counter(
        e if isinstance(e, str) else "still running at the end" for e in ended
    )


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as directory:
        config = two_tenant_config(
            directory,
            "256MiB",
            ["--max-num-seqs", str(args.max_num_seqs)],
            ["--max-queue-ms", str(args.max_queue_ms)],
        )
        with Mesh(config) as mesh:
            async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                await steady(stub, "sk-b", 2.0, 2.0)  # warm
                alone = await steady(stub, "sk-b", args.b_rate, args.seconds)
                stop = asyncio.Event()
                flooding = asyncio.create_task(flood(stub, args, stop))
                await asyncio.sleep(args.warm_seconds)  # the batch fills, the queue builds
                beside = await steady(stub, "sk-b", args.b_rate, args.seconds)
                stop.set()
                ended = await flooding
    alone_p99 = percentile([r.ttft for r in alone if r is not None], 99)
    print(
        f"A: n = 16 x {args.a_tokens} tokens every {args.a_interval:g} s; "
        f"B: {args.b_rate} req/s for {args.seconds:.0f} s; --max-num-seqs {args.max_num_seqs}, "
        f"--max-queue-ms {args.max_queue_ms:g}"
    )
    print(TABLE_HEAD)
    print(row("alone", alone, alone_p99))
    print(row("beside tenant A's n = 16 flood", beside, alone_p99))
    print("A's requests: " + ", ".join(f"{kind}: {count}" for kind, count in ended.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--a-interval", type=float, default=0.5, help="s between A's sends")
    parser.add_argument("--a-tokens", type=int, default=256, help="max_tokens of A's requests")
    parser.add_argument("--b-rate", type=float, default=1.0, help="B's requests per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="B's sending time per phase")
    parser.add_argument("--warm-seconds", type=float, default=5.0)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-queue-ms", type=float, default=2000.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

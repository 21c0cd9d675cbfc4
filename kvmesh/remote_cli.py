"""`generate --addr` and `chat`: the CLI against a running mesh's gateway."""

from __future__ import annotations

import argparse
import sys

from kvmesh.client import MeshClient, generate_request
from shared.errors import KvmeshError
from shared.outputs import finish_reason_label
from shared.pb.kvmesh.v1 import inference_pb2


def add_remote_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--addr",
        nargs="?",
        const="up",
        help="gateway HOST:PORT of a running mesh; alone: the mesh `kvmesh up` started "
        "(without it, generate runs the engine in this process)",
    )
    parser.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable; mesh only)"
    )
    parser.add_argument("--timeout", type=float, help="deadline in seconds (mesh only)")


def stream_to_terminal(
    address: str, request: inference_pb2.GenerateRequest, timeout: float | None
) -> int:
    """Streams one answer to stdout; a summary line to stderr. Exit 2 on any failure."""
    with MeshClient(address) as client:
        for event in client.stream(request, timeout=timeout):
            kind = event.WhichOneof("event")
            if kind == "delta":
                sys.stdout.write(event.delta.text)
                sys.stdout.flush()
            elif kind == "completed":
                done = event.completed
                reason = finish_reason_label(done.finish_reason)
                sys.stdout.write("\n")
                moved = done.execution.handover
                handover = (
                    f"; {moved.blocks} blocks handed over from {moved.prefill_worker} "
                    f"({moved.outcome})"
                    if done.execution.HasField("handover")
                    else ""
                )
                print(
                    f"[{reason}; "
                    f"{done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} "
                    f"tokens; ttft {done.timings.ttft_ms:.0f} ms, "
                    f"total {done.timings.total_ms:.0f} ms{handover}]",
                    file=sys.stderr,
                )
            elif kind == "cancelled":
                print("\n[cancelled]", file=sys.stderr)
                return 2
            elif kind == "failed":
                error = event.failed.error
                print(f"\nkvmesh: error: {error.reason}: {error.message}", file=sys.stderr)
                return 2
    return 0


def run_remote_generate(args: argparse.Namespace, sampling: dict) -> int:
    if args.raw:
        request = generate_request(args.prompt, stop=args.stop, **sampling)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        request = generate_request(messages=messages, stop=args.stop, **sampling)
    return stream_to_terminal(args.addr, request, args.timeout)


def run_chat(args: argparse.Namespace, sampling: dict) -> int:
    """A conversation: each line you type is a user turn; the history goes with every call."""
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    with MeshClient(args.addr) as client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            request = generate_request(messages=messages, stop=args.stop, **sampling)
            answer = _stream_answer(client, request, args.timeout)
            if answer is None:
                messages.pop()  # a failed turn is not part of the conversation
                continue
            messages.append({"role": "assistant", "content": answer})


def _stream_answer(
    client: MeshClient, request: inference_pb2.GenerateRequest, timeout: float | None
) -> str | None:
    answer: list[str] = []
    try:
        for event in client.stream(request, timeout=timeout):
            kind = event.WhichOneof("event")
            if kind == "delta":
                answer.append(event.delta.text)
                sys.stdout.write(event.delta.text)
                sys.stdout.flush()
            elif kind == "failed":
                error = event.failed.error
                print(f"\nkvmesh: error: {error.reason}: {error.message}", file=sys.stderr)
                return None
    except KvmeshError as error:
        print(f"kvmesh: error: {error}", file=sys.stderr)
        return None
    sys.stdout.write("\n")
    return "".join(answer)

